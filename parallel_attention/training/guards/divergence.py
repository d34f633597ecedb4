"""The divergence guard: a non-finite step stops the run instead of being skipped forever.

Every rank judges the same numbers (the loss averaged over data-parallel ranks and the global gradient
norm are already agreed by their collectives), so every rank reaches the same verdict with no extra
communication.

    dtype              non-finite loss     non-finite gradient norm
    float32, bfloat16  stop                stop
    float16            stop                a loss-scale overflow: skip the update and halve the scale;
                                           stop after more than `training.max_skipped_steps` in a row

A stopped step is still logged (non-finite values as JSON `null`, see metrics), then `raise_if_stopped`
raises DivergenceError naming the step and what was non-finite, before anything is evaluated or saved:
no checkpoint is written from a diverged state, and the newest checkpoint stays the last good one.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...tensor_parallel.collectives import any_rank
from ...tensor_parallel.param_kinds import local_shard
from .rank_checks import GuardError
from ..loss_scaler import DynamicLossScaler

__all__ = ["DivergenceError", "DivergenceGuard", "check_parameters_finite"]

_FIX = ("lower optimizer.lr (or lengthen schedule.warmup_steps, or set optimizer.grad_clip), then restart "
        "with --resume; the newest checkpoint holds the updates up to its step, so if the run diverges again "
        "from it, resume from an older one (--resume RUN_DIR/checkpoints/step_NNNNNNN)")


class DivergenceError(GuardError):
    """Training produced non-finite values; the message names the step, what was non-finite and the fix."""


class DivergenceGuard:
    """Counts skipped steps and decides, step by step, whether the optimizer may step or the run must stop."""

    def __init__(self, scaler: DynamicLossScaler, max_skipped_steps: int, dtype: str) -> None:
        self.scaler, self.max_skipped_steps, self.dtype = scaler, max_skipped_steps, dtype
        self.skipped_steps = 0  # over the whole run (restored on resume)
        self.consecutive = 0
        self.stop_reason: str | None = None

    def update(self, step: int, loss: float, grad_norm: float) -> bool:
        """Judge step `step`; True when its update may be applied. Updates the loss scale in fp16."""
        overflow_allowed = self.scaler.enabled and math.isfinite(loss)
        apply = self.scaler.update(grad_norm) if overflow_allowed else math.isfinite(loss) and math.isfinite(grad_norm)
        if apply:
            self.consecutive = 0
            return True
        self.skipped_steps += 1
        self.consecutive += 1
        if not overflow_allowed:
            bad = " and ".join(f"{name} ({value})" for name, value in (("loss", loss), ("grad_norm", grad_norm))
                               if not math.isfinite(value))
            self.stop_reason = f"step {step}: non-finite {bad} in {self.dtype}"
        elif self.consecutive > self.max_skipped_steps:
            self.stop_reason = (f"step {step}: non-finite grad_norm ({grad_norm}) for {self.consecutive} consecutive "
                                f"fp16 steps (training.max_skipped_steps={self.max_skipped_steps}; loss scale now "
                                f"{self.scaler.scale:g})")
        return False

    def raise_if_stopped(self) -> None:
        if self.stop_reason is not None:
            raise DivergenceError(f"{self.stop_reason}: the run diverged and stops without saving a checkpoint; "
                                  f"{_FIX}.")

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))


@torch.no_grad()
def check_parameters_finite(model: nn.Module, step: int, device: torch.device) -> None:
    """Raise DivergenceError on every rank if any rank holds a non-finite parameter (one all-reduce)."""
    named = list(model.named_parameters())
    finite = torch.stack([torch.isfinite(local_shard(p).tensor).all() for _, p in named]).tolist() if named else []
    bad = [name for (name, _), ok in zip(named, finite) if not ok]
    if any_rank(bool(bad), device):
        where = f"here: {', '.join(bad[:5])}" if bad else "on another rank"
        raise DivergenceError(f"step {step}: non-finite parameters ({where}); not saving a checkpoint; {_FIX}.")
