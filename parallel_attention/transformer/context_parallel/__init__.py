"""Context parallelism: the sequence split across the cp ranks inside attention (zigzag order, see `zigzag`).

Two kinds, chosen once in ParallelSelfAttention.__init__ (`context_parallel_kind`):
- "ring" (`ring_attention`): k/v blocks travel the ring, partial outputs merged by log-sum-exp;
- "all_to_all" (`ulysses`): heads <-> sequence all-to-all around the block's own core attention.
At cp = 1 neither exists: the block runs its plain core attention, unchanged.

Attention dropout under CP needs dropout_rng='layout_invariant' (both kinds draw cp = 1's hashed masks; the
tensor-parallel generator's are refused, `ring_dropout.check_dropout_rng`). Collectives per layer on each rank,
besides tensor parallelism's own (docs/architecture.md, "Communication per block"); a ring exchange is one send and
one receive (per tensor), batched into one batch_isend_irecv per ring step (backward: cp steps and the last dK/dV
home, cp + 1 batches):

    kind         recompute     forward                   backward
    ring         none          cp - 1 ring exchanges     2 cp - 1 (cp - 1 k/v on, cp dK/dV home)
    ring         full          cp - 1                    3 cp - 2 (the forward ring replayed first)
    ring         selective     cp - 1                    2 cp - 1 (nothing s x s kept: the ring is left as it is)
    all_to_all   none          3 all-to-all (q k v, out) 3
    all_to_all   full          3                         6 (the forward's 3 replayed)
    all_to_all   selective     3                         3 (only the local core is recomputed)

Full recomputation also replays TP's forward all-reduces (2 per layer without SP); attention dropout adds none.
Asserted in tests/test_context_parallel.py (per block) and tests/test_context_parallel_recompute.py (per model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...tensor_parallel.collectives import all_reduce
from ...tensor_parallel.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from ...tensor_parallel.parallel_state import ProcessGroup, group_rank, group_size
from ..kernels.core_attention import build_core_attention
from ..kernels.device_choice import ChosenByDevice
from ..documents import positions_of
from .ring_attention import BlockMasks, RingAttention, RingPlan
from ..kernels.choice import choose_blocks
from .ring_dropout import RingDropoutSpec, check_dropout_rng
from .ulysses import UlyssesAttention, check_heads
from .zigzag import (check_zigzag, gather_from_context_parallel, held_positions, split_for_context_parallel,
                     zigzag_indices)

CONTEXT_PARALLEL_KINDS = ("ring", "all_to_all")
__all__ = ["CONTEXT_PARALLEL_KINDS", "ContextParallelPart", "build_context_parallel_core",
           "gather_from_context_parallel", "held_positions", "split_for_context_parallel",
           "zigzag_indices"]


class RingCoreAttention(ChosenByDevice):
    """The ring as a core attention module: q, k, v [b, heads, 2m, d] this rank's zigzag part. `dropout`: a
    RingDropoutSpec (attention dropout, dropout_rng='layout_invariant', in training) or None. The per-pair kernel
    (kernels/ring_blocks) is chosen from the device (kernels/choice) at construction and again when the module
    moves, never per call."""

    def __init__(self, cp_group: ProcessGroup, queries_per_group: int, dropout: RingDropoutSpec | None = None,
                 kernel: str = "auto", device=None) -> None:
        super().__init__(device)
        self.cp_group, self.queries_per_group, self.dropout, self.kernel = cp_group, queries_per_group, dropout, kernel
        self._plan = self._plan_with_dropout if dropout is not None else self._plan_without_dropout
        self._choose()

    def _choose(self) -> None:
        self.blocks = choose_blocks(self.device, self.kernel, self.dropout is not None)

    def _plan_without_dropout(self, masks: BlockMasks) -> RingPlan:
        return RingPlan(self.cp_group, masks, self.queries_per_group, blocks=self.blocks)

    def _plan_with_dropout(self, masks: BlockMasks) -> RingPlan:
        dropout = self.dropout.for_call(masks.m, group_size(self.cp_group), self.training)
        return RingPlan(self.cp_group, masks, self.queries_per_group, dropout, self.blocks)

    def forward(self, q, k, v, mask, causal: bool, documents=None) -> torch.Tensor:
        if mask is not None:
            raise ValueError("context_parallel_kind='ring' takes no attention_mask (it masks per block: causal and "
                             "documents): pass document_ids for packed sequences, or use context_parallel_kind="
                             "'all_to_all', which takes any mask.")
        masks = BlockMasks(q.shape[-2] // 2, causal, documents, q.device)
        return RingAttention.apply(q, k, v, self._plan(masks))


def build_context_parallel_core(kind: str, config, cp_group: ProcessGroup, head_offset: int, heads: tuple[int, int],
                                layer: int, recompute: bool, device=None) -> nn.Module:
    """The core attention of context-parallel `kind` over `cp_group` (size > 1); `heads` = (nhl, nkvl) on this
    tensor-parallel rank, whose first global head is `head_offset`. `recompute` (selective) applies to the core
    inside the all-to-all; the ring already keeps only q, k, v, its output and the lse (flash-style)."""
    nhl, nkvl = heads
    cp = group_size(cp_group)
    if kind not in CONTEXT_PARALLEL_KINDS:
        raise ValueError(f"context_parallel_kind={kind!r} is not one of {CONTEXT_PARALLEL_KINDS}.")
    check_dropout_rng(config, kind, cp)  # attention dropout under CP: the hashed masks of cp = 1 only
    if kind == "ring":
        dropout = RingDropoutSpec(config.attention_dropout, config.num_heads, head_offset, layer) \
            if config.attention_dropout > 0 else None
        return RingCoreAttention(cp_group, nhl // nkvl, dropout, config.attention_kernel, device)
    check_heads(nhl, cp)
    core = build_core_attention(config, head_offset + group_rank(cp_group) * (nhl // cp), layer, recompute, device)
    return UlyssesAttention(core, cp_group, nhl, nkvl)


class ContextParallelPart:
    """This rank's part of the sequence: its tokens, positions, documents and share of the loss (the identity at
    cp = 1)."""

    def __init__(self, cp_group: ProcessGroup | None) -> None:
        self.group, self.cp, self.rank = cp_group, group_size(cp_group), group_rank(cp_group)

    def keep_part(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The part of full-sequence `t` (tokens, labels: dim 1) this rank holds."""
        return split_for_context_parallel(t, self.group, dim)

    def position_table(self, table: torch.Tensor, documents, offset: int, s_local: int) -> torch.Tensor:
        """Learned positions of this rank's tokens from `table` [max_seq_len, h]: [s, b, h] (documents: restarted)
        or [s, 1, h]."""
        if documents is not None:
            positions = documents.positions if self.cp == 1 else documents.positions[:, self._index(s_local, table)]
            return F.embedding(positions.t(), table)
        if self.cp == 1:
            return table[offset:offset + s_local].unsqueeze(1)
        return table[self._index(s_local, table) + offset].unsqueeze(1)

    def _index(self, s_local: int, like: torch.Tensor) -> torch.Tensor:
        return zigzag_indices(self.full_length(s_local), self.cp, self.rank, like.device)

    def mean_loss(self, loss_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """The token mean over the whole sequence, equal on every cp rank. Its backward all-reduces too, so each
        rank's gradient is cp x its tokens' share: averaged over dp x cp (DDP), that is the global gradient."""
        if self.cp == 1:
            return loss_sum / count
        total = reduce_from_tensor_parallel_region(copy_to_tensor_parallel_region(loss_sum, self.group), self.group)
        return total / all_reduce(count.clone(), self.group)

    def full_length(self, s_local: int) -> int:
        return s_local * self.cp

    def positions(self, documents, position_ids, s_local: int, device) -> torch.Tensor | None:
        """The global positions of this rank's tokens: the caller's (already this part's), else the documents'
        restarted ones, else the global indices (None at cp = 1: the default)."""
        if position_ids is not None or self.cp == 1:
            return positions_of(documents, position_ids)
        index = zigzag_indices(self.full_length(s_local), self.cp, self.rank, device)
        return index if documents is None else documents.positions[:, index]

    def check(self, s_local: int) -> None:
        if self.cp > 1:
            check_zigzag(self.full_length(s_local), self.cp)
