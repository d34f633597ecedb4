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
def update_expert_bias(model: nn.Module) -> None:
    """After the step's last backward: bias += rate * sign(mean load - load) for every router with a bias, then
    its counts restart. The counts are summed over each router's `count_groups` (the layer's: dp x cp, and tp
    under sequence parallelism), every router of the model in one all-reduce per group."""
    routers = [m for m in model.modules() if hasattr(m, "update_bias")]  # the MoE layers' routers (router.py)
    biased = [r for r in routers if r.e_score_correction_bias is not None]
    if biased:
        counts = torch.stack([r.step_counts for r in biased])
        for group in biased[0].count_groups:
            all_reduce(counts, group)
        for router, global_counts in zip(biased, counts):
            router.update_bias(global_counts)
    for router in routers:
        router.step_counts.zero_()
