"""All-to-all (Ulysses) context parallelism: the sequence split becomes a head split for the attention core.

Shapes (per rank, cp ranks): q [b, nhl, s/cp, d], k, v [b, nkvl, s/cp, d], this rank's zigzag part.

    all-to-all (heads -> sequence): q [b, nhl/cp, s, d], k, v [b, nkvl'/cp, s, d], the full sequence in global
      order (the parts arrive in rank order and are put back in token order by one index)
    the block's own core attention (any kernel, masks, documents and layout_invariant dropout as at cp = 1)
    all-to-all back (sequence -> heads): [b, nhl, s/cp, d], this rank's part again

Needs nhl divisible by cp. K/v heads that cp does not divide are replicated first (each by
cp / gcd(nkvl, cp)), as TP replicates them when p > nkv; autograd sums the replicas' gradients.
Collectives per layer: forward 3 all-to-all (q, k and v stacked, output), backward the same 3.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...tensor_parallel.collectives import all_to_all_along_dims
from ...tensor_parallel.parallel_state import ProcessGroup, group_size
from ..kernels.kv_groups import repeat_kv
from .zigzag import rank_order_to_global


def check_heads(num_heads_per_rank: int, cp: int) -> None:
    if num_heads_per_rank % cp != 0:
        raise ValueError(f"context_parallel_kind='all_to_all' needs the query heads per tensor-parallel rank "
                         f"({num_heads_per_rank}) divisible by context_parallel_size={cp}: choose a cp that divides "
                         f"{num_heads_per_rank}, or context_parallel_kind='ring', which has no such limit.")


class UlyssesAttention(nn.Module):
    """The all-to-all around `core` (a core attention module built for nhl / cp heads of the full sequence)."""

    def __init__(self, core: nn.Module, cp_group: ProcessGroup, num_heads_per_rank: int,
                 num_kv_heads_per_rank: int) -> None:
        super().__init__()
        self.core, self.cp_group, self.cp = core, cp_group, group_size(cp_group)
        check_heads(num_heads_per_rank, self.cp)
        self.kv_repeat = self.cp // math.gcd(num_kv_heads_per_rank, self.cp)

    def _to_full_sequence(self, t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        gathered = all_to_all_along_dims(t, 1, -2, self.cp_group)  # heads split, parts concatenated in rank order
        return gathered.index_select(-2, torch.argsort(order))

    def forward(self, q, k, v, mask, causal: bool, documents=None) -> torch.Tensor:
        s = q.shape[-2] * self.cp
        order = rank_order_to_global(s, self.cp, q.device)
        k, v = (repeat_kv(t, t.shape[1] * self.kv_repeat) for t in (k, v))
        q = self._to_full_sequence(q, order)
        # one all-to-all for k and v: piece j holds [k heads of j | v heads of j]
        kv = torch.stack([k, v], dim=1).unflatten(2, (self.cp, -1)).transpose(1, 2).flatten(1, 3)
        k, v = self._to_full_sequence(kv, order).unflatten(1, (2, -1)).unbind(1)
        context = self.core(q, k, v, mask, causal, documents)  # [b, nhl / cp, s, d]
        return all_to_all_along_dims(context.index_select(-2, order), -2, 1, self.cp_group)
