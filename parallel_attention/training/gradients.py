"""The global gradient norm and clipping, after every reduction of a step (the data-parallel average runs
inside the backward, `data_parallel`; the tensor-parallel partial sums in `finalize_grads`).

- `all_reduce_data_parallel`: the data-parallel average in flat buckets after the backward (the guarded path).
- `global_grad_norm`: the norm of the whole model's gradient with each parameter counted once, read off the
  declared parameter kinds (`tensor_parallel.grad_clip`, shared with `parallel_attention.clip_grad_norm_`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..tensor_parallel.collectives import all_reduce
from ..tensor_parallel.grad_clip import global_grad_norm, scale_grads_
from ..tensor_parallel.parallel_state import ProcessGroup, group_size

__all__ = ["all_reduce_data_parallel", "clip_gradients", "global_grad_norm"]


@torch.no_grad()
def all_reduce_data_parallel(params: list[nn.Parameter], group: ProcessGroup | None, bucket_mb: float = 64) -> int:
    """Average `.grad` across the data-parallel group in flat buckets, after the backward, through `collectives`;
    returns the number of all-reduces issued. Training uses DDP; this is the path of parallel.debug_collectives
    (see data_parallel.ReducedAfterBackward)."""
    world = group_size(group)
    if world == 1:
        return 0
    buckets, current, size = [], [], 0
    limit = bucket_mb * 2**20
    for g in (p.grad for p in params if p.grad is not None):
        if current and (size + g.numel() * g.element_size() > limit or g.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(g)
        size += g.numel() * g.element_size()
    if current:
        buckets.append(current)
    for bucket in buckets:
        flat = all_reduce(torch.cat([g.reshape(-1) for g in bucket]), group).div_(world)
        for g, reduced in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(reduced.view_as(g))
    return len(buckets)


@torch.no_grad()
def clip_gradients(model: nn.Module, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / total_norm); max_norm <= 0 disables clipping."""
    if max_norm <= 0:
        return
    scale_grads_(model, max_norm, total_norm)
