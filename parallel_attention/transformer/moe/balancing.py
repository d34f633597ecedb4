"""DeepSeek-V3's auxiliary-loss-free balancing, once per step: every router's bias moved by its layer's load.

The counts each router gathered during the step's training forwards are summed over every rank that holds other
tokens of the step (dp x cp, and tp under sequence parallelism) in one all-reduce, so the bias is the same at
every layout. Recomputed forwards count again, but every expert of the layer alike: the sign of each expert's
excess load, all the update reads, does not change.
"""

from __future__ import annotations

import torch
from torch import nn

from ...tensor_parallel.collectives import all_reduce


@torch.no_grad()
def update_expert_bias(model: nn.Module, applied: bool = True) -> None:
    """After the step's last backward: bias += rate * sign(mean load - load) for every router with a bias when the
    step's update is `applied`, then the counts restart either way. A step the guard skips (an fp16 overflow)
    leaves the biases as they were, as it leaves every other parameter. The counts are summed over each router's
    `count_groups` (the layer's: dp x cp, and tp under sequence parallelism), every router of the model in one
    all-reduce per group (no collective on a skipped step: every rank judges the step alike)."""
    routers = [m for m in model.modules() if hasattr(m, "update_bias")]  # the MoE layers' routers (router.py)
    biased = [r for r in routers if r.e_score_correction_bias is not None]
    if biased and applied:
        counts = torch.stack([r.step_counts for r in biased])
        for group in biased[0].count_groups:
            all_reduce(counts, group)
        for router, global_counts in zip(biased, counts):
            router.update_bias(global_counts)
    for router in routers:
        router.step_counts.zero_()
