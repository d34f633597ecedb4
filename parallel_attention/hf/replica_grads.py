"""Gradients of k/v head replicas completed inside the backward (p > nkv).

When p > num_kv_heads, several ranks hold the same k/v head (rows `rows` of the fused QKV weight and bias), and
each rank's gradient of those rows covers only its own queries. A transformers training loop never calls
`finalize_grads`, so the sum runs in the autograd graph, at the use site of the weight:

    weight, bias (this rank's fused rows)
      | forward: identity
      | backward: rows `rows` of each gradient summed over the ranks sharing this rank's slot (its k/v head):
      |           one all-reduce of a [num_slots, rows] buffer, zeros outside this rank's slot
    F.linear(x, weight, bias)

The parameters declare `KvReplica(..., reduced_in_backward=True)`: the norm counts the replica rows once and
`finalize_grads` leaves them alone.
"""

from __future__ import annotations

import torch

from ..tensor_parallel.collectives import all_reduce
from ..tensor_parallel.parallel_state import ProcessGroup


class _CompleteReplicaGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, slot, num_slots, group, *tensors):
        ctx.rows, ctx.slot, ctx.num_slots, ctx.group = rows, slot, num_slots, group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        parts = [g[ctx.rows].reshape(-1) for g in grads]
        sizes = [part.numel() for part in parts]
        buffer = grads[0].new_zeros(ctx.num_slots, sum(sizes))
        buffer[ctx.slot] = torch.cat(parts)
        summed = all_reduce(buffer, ctx.group)[ctx.slot].split(sizes)
        completed = []
        for grad, total in zip(grads, summed):
            grad = grad.clone()
            grad[ctx.rows] = total.view_as(grad[ctx.rows])
            completed.append(grad)
        return (None, None, None, None, *completed)


def complete_replica_grads(tensors: tuple, rows: slice, slot: int, num_slots: int,
                           group: ProcessGroup | None) -> tuple:
    """`tensors` unchanged forward; backward, rows `rows` of each gradient summed across the ranks sharing `slot`."""
    return _CompleteReplicaGrads.apply(rows, slot, num_slots, group, *tensors)
