"""Mixture of experts (docs/moe.md): the MoE layer, its router, experts, dispatch and auxiliary losses.

What a training step needs from here: run its forwards and backwards inside `moe_step(loss_scale)` (the scale it
multiplies its language-model loss by), read the StepRecord it yields (`metrics()`) for its metrics row, and call
`update_expert_bias(model, applied)` once it knows whether the step's update applies.
"""

from .balancing import update_expert_bias
from .counted_tokens import counted_tokens_of, replaying
from .layer import MoELayer, build_mlp
from .losses import StepRecord, moe_step
from .router import TopKRouter

__all__ = ["MoELayer", "build_mlp", "StepRecord", "TopKRouter", "counted_tokens_of", "moe_step", "replaying",
           "update_expert_bias"]
