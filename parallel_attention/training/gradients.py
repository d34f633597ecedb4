"""Gradient reductions of a training step beyond the tensor-parallel ones (see grads.finalize_grads).

- `all_reduce_data_parallel`: average gradients across data-parallel replicas in flat buckets.
- `global_grad_norm`: the norm of the whole model's gradient, each parameter counted once:
  tensor-parallel shards add up across the TP group, replicated parameters are counted on TP
  rank 0 only, and replicated k/v heads (p > num_kv_heads) once per replica set.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..attention import ParallelSelfAttention
from ..layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..parallel_state import ProcessGroup, group_rank, group_size


@torch.no_grad()
def all_reduce_data_parallel(params: list[nn.Parameter], group: ProcessGroup | None, bucket_mb: float = 64) -> int:
    """Average `.grad` across the data-parallel group; returns the number of all-reduces issued."""
    world = group_size(group)
    if world == 1:
        return 0
    grads = [p.grad for p in params if p.grad is not None]
    buckets, current, size = [], [], 0
    limit = bucket_mb * 2**20
    for g in grads:
        if current and (size + g.numel() * g.element_size() > limit or g.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(g)
        size += g.numel() * g.element_size()
    if current:
        buckets.append(current)
    for bucket in buckets:
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(reduced)
    return len(buckets)


def _sharded_parameters(model: nn.Module) -> set[int]:
    sharded = set()
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding)) and m.tp_size > 1:
            sharded.update(id(p) for p in m.parameters(recurse=False))
        elif isinstance(m, RowParallelLinear) and m.tp_size > 1:
            sharded.add(id(m.weight))  # its bias is replicated
    return sharded


@torch.no_grad()
def global_grad_norm(model: nn.Module, tp_group: ProcessGroup | None) -> torch.Tensor:
    """L2 norm of all gradients as if the model were on one rank (call after all reductions)."""
    sharded = _sharded_parameters(model)
    first_tp_rank = group_rank(tp_group) == 0
    params = [p for p in model.parameters() if p.grad is not None]
    device = params[0].grad.device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if id(p) in sharded or first_tp_rank:
            total += p.grad.float().pow(2).sum()
    for m in model.modules():
        if isinstance(m, ParallelSelfAttention) and m.kv_replicated and m.tp_size > 1:
            replicas = m.tp_size // m.config.num_kv_heads
            for entry in m.partial_grads():  # the replicated k/v rows: count 1/replicas of each copy
                total -= (1.0 - 1.0 / replicas) * entry.param.grad[entry.rows].float().pow(2).sum()
    if group_size(tp_group) > 1:
        dist.all_reduce(total, group=tp_group)
    return total.sqrt()


@torch.no_grad()
def clip_gradients(model: nn.Module, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / total_norm); max_norm <= 0 disables clipping."""
    if max_norm <= 0:
        return
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(coefficient.to(p.grad.dtype))
