"""Mixture of experts (docs/moe.md): the MoE layer, its router, experts, dispatch and auxiliary losses.

What a training step needs from here: run its forwards and backwards inside `moe_step(loss_scale)` (the scale
it multiplies its language-model loss by), read `StepRecord.metrics()` for its metrics row, and call
`update_expert_bias(model)` after the backward of its last micro-batch when bias balancing is on.
"""

from .balancing import update_expert_bias
from .layer import MoELayer
from .losses import StepRecord, moe_step
from .router import TopKRouter

__all__ = ["MoELayer", "StepRecord", "TopKRouter", "moe_step", "update_expert_bias"]
