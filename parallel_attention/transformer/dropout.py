"""Dropout on [s, b, h] activations, in the two flavours `model.dropout_rng` chooses between.

per_rank (default): replicated activations draw from the default generator (the same mask on every
    tensor-parallel rank); sequence-parallel chunks hold other tokens per rank, so they draw from the
    tensor-parallel generator. Fast, but the masks depend on the layout (p, SP, dp, micro-batches).
layout_invariant: each mask element is a hash of (seed, step, global sample, layer, site, position,
    channel) (`tensor_parallel.dropout_hash`); a rank computes only the positions it holds, so every
    layout draws the same masks and trains to the same losses. The trainer supplies (seed, step,
    sample) through `tensor_parallel.rng.dropout_coordinates`.

Every dropout site has a stable id: the layer index (given at construction) and a `DropoutSite`.
"""

from __future__ import annotations

from enum import IntEnum

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel.dropout_hash import as_key
from ..tensor_parallel.parallel_state import ProcessGroup, group_rank, group_size
from ..tensor_parallel.rng import current_dropout_coordinates, tensor_parallel_rng


class DropoutSite(IntEnum):
    """Which dropout of a layer a mask belongs to (part of the hashed coordinates: never renumber)."""

    EMBEDDING = 0
    ATTENTION_PROBS = 1
    ATTENTION_OUTPUT = 2
    MLP_OUTPUT = 3


def hashed_dropout(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """x where `keep`, else 0, scaled by 1 / (1 - p); backward keeps only the boolean mask."""
    return torch.where(keep, x, 0.0) * (1.0 / (1.0 - p))


class HiddenDropout(nn.Module):
    """Dropout on [s, b, h] activations from a generator (dropout_rng='per_rank'). Replicated activations
    draw from the default generator (the same mask on every rank); sequence-parallel chunks hold other
    tokens per rank, so they draw from the tensor-parallel generator. Chosen once, at construction."""

    def __init__(self, p: float, sequence_parallel: bool) -> None:
        super().__init__()
        self.p = p
        self._drop = self._drop_per_rank if sequence_parallel else self._drop_replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._drop(x) if self.training and self.p > 0 else x

    def _drop_replicated(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, training=True)

    def _drop_per_rank(self, x: torch.Tensor) -> torch.Tensor:
        with tensor_parallel_rng(x.device):
            return F.dropout(x, self.p, training=True)


class LayoutInvariantDropout(nn.Module):
    """Dropout on [s, b, h] activations whose mask depends on (seed, step, sample, layer, site, position,
    channel) only. Under sequence parallelism this rank holds positions chunk*s_local ..; the chunk
    index (the tensor-parallel rank) is fixed at construction."""

    def __init__(self, p: float, layer: int, site: DropoutSite, chunks: int = 1, chunk: int = 0) -> None:
        super().__init__()
        self.p, self.layer, self.site = p, layer, int(site)
        self.layer_word = as_key(layer)  # hashed as a tensor: one torch.compile graph serves every layer
        self.chunks, self.chunk = chunks, chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._drop(x) if self.training and self.p > 0 else x

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        coords = current_dropout_coordinates()
        # global layout [sample, position, channel] (positions and channels hash as one contiguous run)
        axes = [(coords.first_sample_tensor, b, s * self.chunks * h),  # samples of the step's global batch
                (self.chunk * s, s, h),  # this rank's positions of the whole sequence (s * chunks of them)
                (0, h, 1)]  # channels
        keep = coords.keep_mask(self.p, self.layer_word, self.site, axes, x.device).transpose(0, 1)  # [s, b, h]
        return hashed_dropout(x, keep, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer}, site={DropoutSite(self.site).name}, chunk={self.chunk}/{self.chunks}"


def _zigzag_runs(s_local: int, pieces: int, piece: int, cp: int, cp_rank: int) -> list[tuple[int, int]]:
    """(first global position, count) of each contiguous run of the tokens this rank holds: piece `piece` (of
    `pieces`, the tensor-parallel split under SP) of its zigzag part, chunks cp_rank and 2 cp - 1 - cp_rank of 2 cp
    chunks of m tokens (context_parallel.zigzag)."""
    m = s_local * pieces // 2
    first, end = piece * s_local, (piece + 1) * s_local  # this piece's positions within the part [0, 2m)
    runs = []
    for base, (low, high) in ((cp_rank * m, (0, m)), ((2 * cp - 1 - cp_rank) * m - m, (m, 2 * m))):
        a, b = max(first, low), min(end, high)
        if a < b:
            runs.append((base + a, b - a))
    return runs


class ContextParallelDropout(LayoutInvariantDropout):
    """LayoutInvariantDropout on this rank's zigzag part of the sequence (context parallelism, cp > 1): the
    positions hashed are the global ones it holds (one or two runs), so every cp draws the masks of cp = 1."""

    def __init__(self, p: float, layer: int, site: DropoutSite, chunks: int, chunk: int, cp: int,
                 cp_rank: int) -> None:
        super().__init__(p, layer, site, chunks, chunk)
        self.cp, self.cp_rank = cp, cp_rank

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        coords, total = current_dropout_coordinates(), s * self.chunks * self.cp
        keep = torch.cat([coords.keep_mask(self.p, self.layer_word, self.site,
                                           [(coords.first_sample_tensor, b, total * h), (start, count, h), (0, h, 1)],
                                           x.device)
                          for start, count in _zigzag_runs(s, self.chunks, self.chunk, self.cp, self.cp_rank)], dim=1)
        return hashed_dropout(x, keep.transpose(0, 1), self.p)


def build_hidden_dropout(p: float, dropout_rng: str, sequence_parallel: bool, tp_group: ProcessGroup,
                         layer: int, site: DropoutSite, cp_group: ProcessGroup | None = None) -> nn.Module:
    """The dropout module `dropout_rng` names ('per_rank' or 'layout_invariant') for one site; `cp_group`: the
    context-parallel group whose zigzag part of the sequence x is (None or one rank: all of it)."""
    if dropout_rng == "layout_invariant":
        if group_size(cp_group) > 1:
            pieces = group_size(tp_group) if sequence_parallel else 1
            piece = group_rank(tp_group) if sequence_parallel else 0
            return ContextParallelDropout(p, layer, site, pieces, piece, group_size(cp_group), group_rank(cp_group))
        if not sequence_parallel:
            return LayoutInvariantDropout(p, layer, site)
        return LayoutInvariantDropout(p, layer, site, group_size(tp_group), group_rank(tp_group))
    if dropout_rng == "per_rank":
        return HiddenDropout(p, sequence_parallel)
    raise ValueError(f"model.dropout_rng={dropout_rng!r} is unknown; choose per_rank or layout_invariant.")


def dropout_paths() -> dict[str, str]:
    """Where each `model.dropout_rng` draws its masks from and what it costs (for logs and the self-check)."""
    return {
        "dropout (model.dropout_rng='per_rank', the default)":
            "torch generators (default one for replicated activations, one per tensor-parallel rank for "
            "attention probabilities and sequence-parallel chunks): fastest, masks depend on the layout",
        "dropout (model.dropout_rng='layout_invariant')":
            "masks hashed from (seed, step, sample, layer, head/channel, position): the same losses at every "
            "layout; explicit attention probabilities in training (no fused SDPA/flash dropout), "
            "about 1.25x the step time of per_rank on the tiny CPU config (README)",
    }
