"""The six tensor-parallel regions (Megatron's mappings): where activations enter and leave the part of the
block that runs on this rank's shard, as six autograd functions named after Megatron's, and one entry function
each that returns its input unchanged when the group has one rank (or is None). Their collectives are the
primitives of `collectives`. Shapes: `s` sequence, `b` batch, `h` hidden, `p` group size.

    autograd function (entry function)          forward                 backward
    CopyToModelParallelRegion                   identity                all-reduce
      (copy_to_tensor_parallel_region)
    ReduceFromModelParallelRegion               all-reduce              identity
      (reduce_from_tensor_parallel_region)
    ScatterToModelParallelRegion                keep my last-dim chunk  all-gather last dim
      (scatter_to_tensor_parallel_region)
    GatherFromModelParallelRegion               all-gather last dim     keep my last-dim chunk
      (gather_from_tensor_parallel_region)
    GatherFromSequenceParallelRegion            all-gather dim 0 (s)    reduce-scatter dim 0
      (gather_from_sequence_parallel_region)
    ReduceScatterToSequenceParallelRegion       reduce-scatter dim 0    all-gather dim 0
      (reduce_scatter_to_sequence_parallel_region)
"""

from __future__ import annotations

import torch

from .collectives import all_gather_first_dim, all_gather_into_tensor, all_reduce, reduce_scatter_first_dim
from .parallel_state import ProcessGroup, group_rank, group_size


def _split_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Keep this rank's chunk of the last dim."""
    p = group_size(group)
    if x.shape[-1] % p != 0:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by tensor-parallel size {p}.")
    return x.chunk(p, dim=-1)[group_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather the last dim, [..., n/p] -> [..., n] in rank order.

    Gathered as [p, ..., n/p] (all_gather_into_tensor stacks along dim 0), then one copy into rank order along the
    last dim (no transposed copy of the input)."""
    p, x = group_size(group), x.contiguous()
    out = torch.empty((p * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
    all_gather_into_tensor(out, x, group)
    return out.view(p, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], p * x.shape[-1])


def _all_reduce_copy(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The sum over the group's ranks of a copy of x: autograd may hand the same gradient to other branches, and a
    forward input is the caller's."""
    return all_reduce(x.clone(), group)


class CopyToModelParallelRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_copy(grad, ctx.group), None


class ReduceFromModelParallelRegion(torch.autograd.Function):
    """Forward: all-reduce. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad.view_as(grad), None


class ScatterToModelParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class GatherFromModelParallelRegion(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's chunk of the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather [s/p, ...] into [s, ...]. Backward: reduce-scatter dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_first_dim(grad, ctx.group), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: sum the ranks' [s, ...], keep this rank's [s/p, ...]. Backward: all-gather dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_first_dim(grad, ctx.group), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce."""
    return x if group_size(group) == 1 else CopyToModelParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: all-reduce. Backward: identity."""
    return x if group_size(group) == 1 else ReduceFromModelParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: [..., n] -> this rank's [..., n/p]. Backward: all-gather the last dim."""
    return x if group_size(group) == 1 else ScatterToModelParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: all-gather the last dim, [..., n/p] -> [..., n]. Backward: keep this rank's chunk."""
    return x if group_size(group) == 1 else GatherFromModelParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: all-gather [s/p, ...] into [s, ...]. Backward: reduce-scatter dim 0."""
    return x if group_size(group) == 1 else GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: sum the ranks' [s, ...], keep [s/p, ...]. Backward: all-gather dim 0."""
    return x if group_size(group) == 1 else ReduceScatterToSequenceParallelRegion.apply(x, group)
