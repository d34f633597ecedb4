"""The global gradient norm and clipping, after every reduction of a step (the data-parallel average runs
inside the backward, `data_parallel`; the tensor-parallel partial sums in `finalize_grads`).

- `all_reduce_data_parallel`: the data-parallel average in flat buckets after the backward (the guarded path).
- `global_grad_norm`: the norm of the whole model's gradient with each parameter counted once,
  read off the declared parameter kinds: sharded parameters add up across the tensor-parallel
  group, replicated ones count on its first rank, and partial rows shared by several ranks (k/v
  replicas) count 1/replicas on each.
"""

from __future__ import annotations

import torch
from torch import nn

from ..tensor_parallel.collectives import all_reduce_
from ..tensor_parallel.param_kinds import Partial, Sharded, parameter_kinds
from ..tensor_parallel.parallel_state import ProcessGroup, group_rank, group_size


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
        flat = all_reduce_(torch.cat([g.reshape(-1) for g in bucket]), group).div_(world)
        for g, reduced in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(reduced.view_as(g))
    return len(buckets)


def _squared(x: torch.Tensor) -> torch.Tensor:
    """|x|^2 in float32: vector_norm reads x once (pow(2).sum() writes a squared copy first: 4x slower on CPU)
    and accumulates more accurately."""
    return torch.linalg.vector_norm(x, dtype=torch.float32).square()


def _squared_norm_once(param: nn.Parameter, kind, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's share of |grad|^2 such that the sum over the tensor-parallel group counts it once."""
    squared = _squared(param.grad)
    if isinstance(kind, Sharded):
        return squared
    if isinstance(kind, Partial) and kind.sharded_dim is not None:  # shared rows inside a sharded tensor
        replicas = tp_size // kind.num_slots
        return squared - (1.0 - 1.0 / replicas) * _squared(param.grad[kind.rows])
    return squared if tp_rank == 0 else torch.zeros_like(squared)  # identical on every rank


@torch.no_grad()
def global_grad_norm(model: nn.Module, tp_group: ProcessGroup | None) -> torch.Tensor:
    """L2 norm of all gradients as if the model were on one rank (call after all reductions)."""
    tp_rank, tp_size = group_rank(tp_group), group_size(tp_group)
    total = None
    for param, kind in parameter_kinds(model).values():
        if param.grad is not None:
            share = _squared_norm_once(param, kind, tp_rank, tp_size)
            total = share if total is None else total + share
    return all_reduce_(total, tp_group).sqrt()


@torch.no_grad()
def clip_gradients(model: nn.Module, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / total_norm); max_norm <= 0 disables clipping."""
    if max_norm <= 0:
        return
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(coefficient.to(p.grad.dtype))
