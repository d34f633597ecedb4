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

from typing import Callable

import torch

from .collectives import all_gather_first_dim, all_gather_into_tensor, all_reduce, reduce_scatter_first_dim
from .parallel_state import ProcessGroup, group_rank, group_size

_Op = Callable[[torch.Tensor, ProcessGroup], torch.Tensor]  # what a region runs on the way in or back


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


def _unchanged_view(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """x's values as a new view: what an autograd function returns for "identity"."""
    return x.view_as(x)


class _Region(torch.autograd.Function):
    """A region's autograd function: forward returns `forward_op(x, group)`, backward `backward_op(grad, group)` (on
    the group forward saw), where a region class names its two ops as `ops = (forward_op, backward_op)`: the six
    regions below, one line each, the module docstring's table row by row.

    __init_subclass__ gives each region its own staticmethod forward and backward, closed over its two ops, rather
    than one inherited forward that looks its ops up: torch.compile traces an autograd function through a plain
    static forward, and gives up on the call where forward is a classmethod or finds its class through ctx."""

    ops: tuple[_Op, _Op]  # (forward_op, backward_op)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        forward_op, backward_op = cls.ops

        def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
            ctx.group = group
            return forward_op(x, group)

        def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            return backward_op(grad, ctx.group), None

        cls.forward, cls.backward = staticmethod(forward), staticmethod(backward)

    @classmethod
    def enter(cls, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        """x itself where the group has one rank (or is None): no autograd node, no collective; else the region."""
        return x if group_size(group) == 1 else cls.apply(x, group)


class CopyToModelParallelRegion(_Region): ops = (_unchanged_view, _all_reduce_copy)


class ReduceFromModelParallelRegion(_Region): ops = (_all_reduce_copy, _unchanged_view)


class ScatterToModelParallelRegion(_Region): ops = (_split_last_dim, _gather_last_dim)


class GatherFromModelParallelRegion(_Region): ops = (_gather_last_dim, _split_last_dim)


class GatherFromSequenceParallelRegion(_Region): ops = (all_gather_first_dim, reduce_scatter_first_dim)


class ReduceScatterToSequenceParallelRegion(_Region): ops = (reduce_scatter_first_dim, all_gather_first_dim)


# the entry functions: the region's autograd function applied, or x itself on a group of one rank
copy_to_tensor_parallel_region = CopyToModelParallelRegion.enter
reduce_from_tensor_parallel_region = ReduceFromModelParallelRegion.enter
scatter_to_tensor_parallel_region = ScatterToModelParallelRegion.enter
gather_from_tensor_parallel_region = GatherFromModelParallelRegion.enter
gather_from_sequence_parallel_region = GatherFromSequenceParallelRegion.enter
reduce_scatter_to_sequence_parallel_region = ReduceScatterToSequenceParallelRegion.enter
