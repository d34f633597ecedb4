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
        self.chunks, self.chunk = chunks, chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._drop(x) if self.training and self.p > 0 else x

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        coords = current_dropout_coordinates()
        # global layout [sample, position, channel] (positions and channels hash as one contiguous run)
        axes = [(coords.first_sample, b, s * self.chunks * h),  # samples of the step's global batch
                (self.chunk * s, s, h),  # this rank's positions of the whole sequence (s * chunks of them)
                (0, h, 1)]  # channels
        keep = coords.keep_mask(self.p, self.layer, self.site, axes, x.device).transpose(0, 1)  # [s, b, h]
        return hashed_dropout(x, keep, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer}, site={DropoutSite(self.site).name}, chunk={self.chunk}/{self.chunks}"


def build_hidden_dropout(p: float, dropout_rng: str, sequence_parallel: bool, tp_group: ProcessGroup,
                         layer: int, site: DropoutSite) -> nn.Module:
    """The dropout module `dropout_rng` names ('per_rank' or 'layout_invariant') for one site."""
    if dropout_rng == "layout_invariant":
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
