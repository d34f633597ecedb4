"""The output head's GEMM and its logits gather in one autograd function, computed vocabulary-major.

    rows X [N, h] (replicated)  ->  Y_r^T = E_r X^T  [V_padded/p, N]   this rank's vocabulary rows
                                ->  all-gather along dim 0  ->  Y^T [V_padded, N]   (rank r's rows at r V/p)

Why vocabulary-major: an all-gather stacks the ranks' buffers one after the other, which is exactly the layout of
Y^T, so the full logits are the gathered buffer itself, seen as a [b, s, V] view (strides (s, 1, N)). Gathering
token-major Y_r [N, V/p] instead leaves [p, N, V/p], and putting the columns in place costs one copy of the whole
[N, V] logits (about 20 ms of a 860 ms step on the CPU benchmark; on GPU, one more pass over the largest
activation). The GEMM costs the same either way: BLAS reads X^T and E_r in place.

Both outputs are the function's: the full Y^T (for `.logits`) and this rank's Y_r^T (for the vocabulary-parallel
loss, which overwrites it in place). Backward takes this rank's rows of dY^T (where something read the full
logits) plus dY_r^T (the loss); dX = dY_r E_r is all-reduced while dE_r = dY_r^T X runs.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..tensor_parallel.collectives import all_gather_first_dim, all_reduce
from ..tensor_parallel.parallel_state import ProcessGroup, group_rank


class _VocabMajorHead(torch.autograd.Function):

    @staticmethod
    def forward(ctx, rows, weight, group):
        ctx.save_for_backward(rows, weight)
        ctx.group, ctx.input_dtype = group, rows.dtype
        ctx.set_materialize_grads(False)  # no [V, N] of zeros where nothing read the full logits
        local = weight.mm(rows.t())
        return all_gather_first_dim(local, group), local

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_full, grad_local):
        rows, weight = ctx.saved_tensors
        grad = _local_grad(grad_full, grad_local, ctx.group, weight.shape[0])
        if grad is None:
            return None, None, None
        pending = None
        if ctx.needs_input_grad[0]:
            pending = all_reduce(grad.t().mm(weight.to(grad.dtype)).to(ctx.input_dtype), ctx.group, async_op=True)
        grad_weight = grad.mm(rows.to(grad.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return (pending.wait() if pending is not None else None), grad_weight, None


def _local_grad(grad_full, grad_local, group, per_rank: int):
    """dY_r^T: this rank's rows of the full logits' gradient plus the local output's own (either may be None)."""
    if grad_full is not None:
        start = group_rank(group) * per_rank
        mine = grad_full[start:start + per_rank]
        return mine if grad_local is None else grad_local + mine
    return grad_local


def vocab_major_logits(rows: torch.Tensor, weight: torch.Tensor, group: ProcessGroup):
    """(Y^T [V_padded, N], Y_r^T [V_padded/p, N]) from rows [N, h] and this rank's table rows [V_padded/p, h]:
    one all-gather forward, one all-reduce (of dX) backward."""
    return _VocabMajorHead.apply(rows, weight, group)
