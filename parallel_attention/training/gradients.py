"""The global gradient norm and clipping, after every reduction of a step (the data-parallel average runs
inside the backward, `data_parallel`; the tensor-parallel partial sums in `finalize_grads`).

- `flat_buckets`, `average_into`: gradients reduced as flat buckets (the guarded path and a pipeline's chunks).
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

__all__ = ["all_reduce_data_parallel", "average_into", "clip_gradients", "flat_buckets", "global_grad_norm"]


def flat_buckets(tensors: list[torch.Tensor], bucket_mb: float) -> list[list[torch.Tensor]]:
    """Consecutive `tensors` grouped into buckets of one dtype and at most `bucket_mb` MiB (a larger tensor alone):
    each bucket is reduced as one flat tensor, one collective per bucket."""
    buckets, current, size = [], [], 0
    limit = bucket_mb * 2**20
    for t in tensors:
        if current and (size + t.numel() * t.element_size() > limit or t.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(t)
        size += t.numel() * t.element_size()
    return buckets + [current] if current else buckets


@torch.no_grad()
def average_into(grads: list[torch.Tensor], flat: torch.Tensor, world: int) -> None:
    """Copy the summed flat bucket `flat`, divided by `world`, back into the gradients it was made of."""
    flat.div_(world)
    for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(reduced.view_as(g))


@torch.no_grad()
def all_reduce_data_parallel(params: list[nn.Parameter], group: ProcessGroup | None, bucket_mb: float = 64) -> int:
    """Average `.grad` across the data-parallel group in flat buckets, after the backward, through `collectives`;
    returns the number of all-reduces issued. The path of parallel.debug_collectives at pp = 1 (see
    data_parallel.ReducedAfterBackward); DDP reduces otherwise, and a pipeline's chunks `ChunkReducer`."""
    world = group_size(group)
    if world == 1:
        return 0
    buckets = flat_buckets([p.grad for p in params if p.grad is not None], bucket_mb)
    for bucket in buckets:
        average_into(bucket, all_reduce(torch.cat([g.reshape(-1) for g in bucket]), group), world)
    return len(buckets)


@torch.no_grad()
def clip_gradients(model: nn.Module, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / total_norm); max_norm <= 0 disables clipping."""
    if max_norm <= 0:
        return
    scale_grads_(model, max_norm, total_norm)
