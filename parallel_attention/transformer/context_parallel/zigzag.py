"""The load-balanced (zigzag) split of a sequence across the context-parallel ranks, and its inverse.

The sequence of s tokens is cut into 2 cp chunks of s / (2 cp); rank r holds chunks r and 2 cp - 1 - r, in that
order, so that under a causal mask every rank has the same work (an early chunk with little to see, a late one
with much). Under sequence parallelism the tensor-parallel split applies inside that part: rank (r, t) holds
[s / (cp tp), b, h], piece t of the part.
"""

from __future__ import annotations

import torch

from ...tensor_parallel.collectives import all_gather_along_dim
from ...tensor_parallel.parallel_state import ProcessGroup, group_rank, group_size


def check_zigzag(s: int, cp: int, tp: int = 1) -> None:
    """ValueError unless 2 cp (x tp under SP) divides the sequence length s."""
    if s % (2 * cp * tp) != 0:
        under = f" x tensor-parallel size {tp} (sequence parallel)" if tp > 1 else ""
        raise ValueError(f"sequence length s={s} is not divisible by 2 x context_parallel_size={cp}{under} = "
                         f"{2 * cp * tp}: the zigzag split needs 2 cp equal chunks; pad the sequence to a multiple "
                         f"of {2 * cp * tp} or choose another context_parallel_size.")


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 cp) that context-parallel rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def zigzag_indices(s: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global token indices of rank `rank`'s part of a sequence of length s, in the order it holds them."""
    check_zigzag(s, cp)
    m = s // (2 * cp)
    return torch.cat([torch.arange(c * m, (c + 1) * m, device=device) for c in chunk_ids(cp, rank)])


def split_for_context_parallel(x: torch.Tensor, cp_group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """This rank's part (zigzag order) of the full-sequence tensor `x` along `dim` (the identity at cp = 1)."""
    cp = group_size(cp_group)
    if cp == 1:
        return x
    return x.index_select(dim, zigzag_indices(x.shape[dim], cp, group_rank(cp_group), x.device))


def gather_from_context_parallel(x: torch.Tensor, cp_group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """The full sequence, in global order, from every rank's part along `dim` (no autograd; a collective)."""
    cp = group_size(cp_group)
    if cp == 1:
        return x
    gathered = all_gather_along_dim(x, dim, cp_group)
    s = gathered.shape[dim]
    order = rank_order_to_global(s, cp, x.device)  # position j of `gathered` holds token order[j]
    return gathered.index_select(dim, torch.argsort(order))


def rank_order_to_global(s: int, cp: int, device=None) -> torch.Tensor:
    """`order` such that the parts of every rank concatenated in rank order, indexed by argsort(order), are in
    global order; indexing the global sequence by `order` gives them back."""
    return torch.cat([zigzag_indices(s, cp, r, device) for r in range(cp)])


def held_positions(rows: int, cp_group: ProcessGroup | None, pieces: int = 1, piece: int = 0,
                   device=None) -> torch.Tensor:
    """The global sequence positions of the `rows` positions this rank holds, in its order: piece `piece` of
    `pieces` (the tensor-parallel split under SP) of its zigzag part (the whole sequence at cp = 1)."""
    first, cp = piece * rows, group_size(cp_group)
    if cp == 1:
        return torch.arange(first, first + rows, device=device)
    return zigzag_indices(rows * pieces * cp, cp, group_rank(cp_group), device)[first:first + rows]
