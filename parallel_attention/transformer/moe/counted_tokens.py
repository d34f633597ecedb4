"""Which tokens the auxiliary losses count: those whose label is not ignored (padding, a loss mask, the label
that would predict the next packed document), as the language-model loss counts them.

GPTModel's forward knows the labels (every pipeline chunk gets them, not only the one that computes the loss):
around its layers it sets, for the micro-batch, `labels != ignore_index` cut as the activations are (this cp
rank's zigzag part, this tp rank's piece under sequence parallelism, [s, b] flattened as x's tokens), and each
MoE layer reads it in its forward (`counted_tokens`). Recomputed layers replay the selection of their forward
(`replaying`): a recompute runs during the backward, after other micro-batches' forwards.

Only the losses leave those tokens out: their router choices, their experts' outputs (later tokens attend to
them), the capacity they take and the balancing bias's counts (the experts' real load) stay as they are.
Without labels (a layer called alone, generation) every token counts.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch


class AllTokens:
    """Every token counts."""

    def sum(self, per_token: torch.Tensor) -> torch.Tensor:
        return per_token.sum(0)

    def expert_counts(self, expert_ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return counts

    def number(self, tokens: int, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor([tokens], dtype=like.dtype, device=like.device)


class LabelledTokens(AllTokens):
    """The tokens where `mask` [T] (bool, this rank's, in x's token order) is True."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def sum(self, per_token: torch.Tensor) -> torch.Tensor:
        weights = self.mask.to(per_token.dtype)
        return (per_token * weights.view(-1, *[1] * (per_token.dim() - 1))).sum(0)

    def expert_counts(self, expert_ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        weights = self.mask.to(counts.dtype).repeat_interleave(expert_ids.shape[1])
        return counts.new_zeros(counts.shape).index_add_(0, expert_ids.reshape(-1), weights)

    def number(self, tokens: int, like: torch.Tensor) -> torch.Tensor:
        return self.mask.sum().to(like.dtype).reshape(1)


_CURRENT: AllTokens = AllTokens()


def counted_tokens() -> AllTokens:
    """The tokens the current forward's auxiliary losses count."""
    return _CURRENT


@contextlib.contextmanager
def counting(selection: AllTokens):
    global _CURRENT
    previous, _CURRENT = _CURRENT, selection
    try:
        yield selection
    finally:
        _CURRENT = previous


def replaying(function: Callable) -> Callable:
    """`function`, run inside the selection current now (for a recomputation that runs later)."""
    selection = _CURRENT

    def run(*args):
        with counting(selection):
            return function(*args)
    return run


class LabelledPart:
    """A model's way from the labels to its MoE layers' counted tokens: `keep_part` (the context-parallel part,
    along dim 1 of [b, s]) and `piece` (the sequence-parallel piece along dim 0 of [s, b])."""

    def __init__(self, keep_part: Callable, piece: Callable) -> None:
        self.keep_part, self.piece = keep_part, piece

    def __call__(self, labels: torch.Tensor | None, ignore_index: int):
        """The context of a forward over `labels` [b, s] (None: every token counts)."""
        if labels is None:
            return counting(AllTokens())
        return counting(LabelledTokens(self.piece(self.keep_part(labels != ignore_index, 1).t()).reshape(-1)))


def _nothing_to_count(labels: torch.Tensor | None, ignore_index: int) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def counted_tokens_of(cfg, keep_part: Callable, piece: Callable) -> Callable:
    """A model's (ModelConfig `cfg`) context of a forward over (labels, ignore_index): a LabelledPart with MoE
    layers (keep_part, piece as LabelledPart's), nothing for a dense model."""
    return LabelledPart(keep_part, piece) if cfg.num_experts else _nothing_to_count
