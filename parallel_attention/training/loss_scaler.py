"""Dynamic loss scaling for float16 training, decided on the global gradient norm.

torch's GradScaler checks for inf/NaN per rank; with tensor parallelism one rank's overflow
must skip the step on every rank. The global norm is already reduced across the group, so a
non-finite norm is the one agreed overflow signal.
"""

from __future__ import annotations

import math

import torch


class DynamicLossScaler:
    def __init__(self, enabled: bool, initial_scale: float = 2.0**16, growth_interval: int = 1000,
                 min_scale: float = 1.0) -> None:
        self.enabled, self.scale = enabled, initial_scale if enabled else 1.0
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale(self, params) -> None:
        if self.enabled:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(1.0 / self.scale)

    def update(self, grad_norm: float) -> bool:
        """Record this step's global norm; return False when the step must be skipped."""
        if not self.enabled:
            return math.isfinite(grad_norm)
        if not math.isfinite(grad_norm):
            self.scale = max(self.min_scale, self.scale / 2)
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2
        return True

    def record(self) -> dict:
        """What metrics.jsonl logs of the scaler: the scale in effect, when scaling is on."""
        return {"loss_scale": self.scale} if self.enabled else {}

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
