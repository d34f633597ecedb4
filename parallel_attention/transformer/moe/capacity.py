"""Capacity mode (`model.moe_capacity_factor`): each expert takes at most C of a micro-batch's (token, choice)
slots, and the slots past it are dropped, the same ones at every layout.

    C = ceil(factor * T * k / E)    T the micro-batch's tokens (every rank's part of it), k per token, E experts

Which slots an expert keeps: its first C in the one process's token order, the position along the sequence,
then the row of the micro-batch (x [s, b, h] flattened), Megatron's "position" policy and Switch's. By position
rather than by routing score because a token's fate then depends only on tokens before it (earlier positions, or
the same position of an earlier row), never on a later token of its own sequence: the training forward sees no
future token, as generation does not. Ties cannot occur: a token's k choices go to k distinct experts.

The order is global: the ranks that hold parts of the micro-batch (tp under sequence parallelism, cp, the zigzag
part of each) sum their slots per (sequence position, expert) [s, E] in one all-reduce per group; each of a
rank's slots then counts the other ranks' slots of its expert at earlier positions, plus its own earlier ones.
The data-parallel ranks hold other micro-batches (each has its own capacity), and ep only moves slots: the drop
happens before dispatch. A dropped slot contributes zero (no expert runs it; the shared expert and the residual
still carry the token); the auxiliary losses and the balancing bias count the router's choices, kept or not.

Training forwards only (MoELayer.train): evaluation and generation run dropless. A validation batch is shared
among the dp ranks, so a capacity over each rank's share would depend on dp, and a decoding step with a KV cache
sees only its new tokens; dropless, both give the one process's full forward.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ...tensor_parallel.collectives import all_reduce
from ...tensor_parallel.parallel_state import ProcessGroup, group_size
from ..context_parallel import held_positions


class Slots(NamedTuple):
    """A micro-batch's slots on this rank, with their counts per expert made once: the dispatch reads `counts`,
    the auxiliary losses and the balancing bias `chosen` (a bincount is a host sync on CUDA)."""

    experts: torch.Tensor  # [T k] int64: each (token, choice) slot's expert, token-major; E where dropped
    kept: int  # how many slots an expert runs
    counts: torch.Tensor  # [E] int64: the slots each expert runs
    chosen: torch.Tensor  # [E] int64: the router's choices of each expert, kept or not
    dropped: torch.Tensor  # () float32: the share of the micro-batch's slots dropped (over every rank of it)


class Dropless:
    """Every slot kept (the default)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def __call__(self, expert_ids: torch.Tensor, rows: int) -> Slots:
        flat = expert_ids.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        return Slots(flat, flat.numel(), counts, counts, expert_ids.new_zeros((), dtype=torch.float32))


class TokenCapacity:
    """Drops the slots past each expert's capacity, in the global token order (module docstring).

    token_groups: the groups whose ranks hold other tokens of the micro-batch; pieces, piece: this rank's piece
    of its part of the sequence (the tensor-parallel split under SP); cp_group: whose zigzag part it is."""

    def __init__(self, factor: float, num_experts: int, token_groups: tuple[ProcessGroup | None, ...],
                 cp_group: ProcessGroup | None, pieces: int = 1, piece: int = 0) -> None:
        if not factor > 0:
            raise ValueError(f"moe_capacity_factor={factor} must be > 0 (null: dropless).")
        self.factor, self.num_experts = factor, num_experts
        self.token_groups = tuple(g for g in token_groups if group_size(g) > 1)
        self.cp_group, self.pieces, self.piece = cp_group, pieces, piece

    def capacity(self, tokens: int, top_k: int) -> int:
        """C for a micro-batch of `tokens` tokens."""
        return math.ceil(self.factor * tokens * top_k / self.num_experts)

    @torch.no_grad()
    def __call__(self, expert_ids: torch.Tensor, rows: int) -> Slots:
        """expert_ids [T, k] of this rank's tokens, `rows` sequence positions of T / rows rows each."""
        E, (T, k) = self.num_experts, expert_ids.shape
        flat, device = expert_ids.reshape(-1), expert_ids.device
        row_of_slot = torch.arange(T * k, device=device) // (T // rows * k)
        mine = torch.bincount(row_of_slot * E + flat, minlength=rows * E).view(rows, E)  # [rows, E]
        positions = held_positions(rows, self.cp_group, self.pieces, self.piece, device)
        every = torch.zeros(rows * self.pieces * group_size(self.cp_group), E, dtype=mine.dtype, device=device)
        every[positions] = mine
        for group in self.token_groups:
            all_reduce(every, group)
        # the other ranks' slots of each expert at earlier positions ([rows, E]: mine are all at my positions)
        before = (every.cumsum(0) - every)[positions] - (mine.cumsum(0) - mine)
        order = torch.argsort(flat, stable=True)  # my slots by expert, in token order within each
        counts = torch.bincount(flat, minlength=E)
        first = torch.cumsum(counts, 0) - counts
        place = torch.empty_like(flat)
        place[order] = torch.arange(T * k, device=device) - first[flat[order]]
        capacity = self.capacity(every.shape[0] * (T // rows), k)
        keep = place + before[row_of_slot, flat] < capacity
        dropped = (every.sum(0) - capacity).clamp(min=0).sum() / every.sum()
        experts = torch.where(keep, flat, E)
        kept = torch.bincount(experts, minlength=E + 1)[:E]
        return Slots(experts, int(keep.sum()), kept, counts, dropped.float())
