"""The parallel linears' autograd functions: each GEMM fused with the collective of its region.

One function per variant, chosen by the layer in `__init__` (`layers.py`); none tests a flag, a device or an
environment variable when it runs. Shapes: `s` sequence, `b` batch, `in`/`out` features, `p` TP size.

    variant                      forward                          backward
    local_linear (p = 1)         Y = X W^T + b                    dX = dY W; dW = dY^T X
    column, tensor parallel      Y = X W_r^T + b_r                dX = dY W_r -> all-reduce, overlapped with dW
    column, sequence parallel    all-gather X along s, then Y     all-gather X again (async, while dX = dY W_r
                                 (keeps only this rank's X chunk)  runs), reduce-scatter dX (async, while dW runs)
    row, tensor parallel         Y_r = X_r W_r^T -> all-reduce    dX_r = dY W_r; dW_r = dY^T X_r
    row, sequence parallel       Y_r -> reduce-scatter along s    all-gather dY along s, then as above

The sequence-parallel column keeps its [s/p, b, in] input, not the gathered [s, b, in], and gathers it again in
backward: Korthikanti et al. 2022's activation memory, for one more all-gather per column-parallel linear per
backward. `overlap_comm` decides only when the backward waits for a collective (`wait_policy`): at once
(`wait_at_once`), or after the GEMM that can run meanwhile (`wait_after_next_gemm`, Megatron's async dgrad).
On CUDA, ProcessGroupNCCL runs an async collective on its own stream after an event wait on the current one, and
wait() makes the current stream wait for it; on gloo the collective runs on gloo's thread while this one computes.

Every collective reduces a tensor its own GEMM just produced, in place (no defensive clone). Autocast: each public
function casts its input to the autocast dtype once, before the region (`autocast_input`), as Megatron's half
layout keeps it: the sequence-parallel all-gathers, the reduce-scatter and all-reduce of dX and the saved input are
then half precision (a float32 input would double their bytes; the GEMM casts it anyway, so the forward is the
same); the cast's own backward returns dX to the input's dtype. The forward GEMM runs under the caller's autocast;
the backward casts the weight to the gradient's dtype and each gradient back to its tensor's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .collectives import (CompletedCollective, PendingCollective, all_gather_first_dim, all_reduce,
                          reduce_scatter_first_dim)
from .parallel_state import ProcessGroup
from .weight_grads import weight_grad

OVERLAP_COMM = True  # the default of every layer that takes overlap_comm (and of GPTModel, parallel.overlap_comm)


def _own_tensor(y: torch.Tensor) -> torch.Tensor:
    """y, or where y is a reshape of a GEMM's 2-D result (F.linear's with a bias), the same memory as a tensor of
    its own (`_unsafe_view`, the reshape torch's matmul uses): autograd forbids overwriting a custom function's
    view output in place, and the model's loss overwrites the logits."""
    return y if y._base is None else torch.ops.aten._unsafe_view(y._base, y.shape)


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x in the autocast dtype where autocast is on for x's device and would cast x (not float64), else x itself."""
    device = x.device.type
    if not torch.is_autocast_enabled(device) or not x.is_floating_point() or x.dtype == torch.float64:
        return x
    return x.to(torch.get_autocast_dtype(device))


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _own_tensor(F.linear(x, weight, bias))


def _input_grad(grad: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dX = dY W, in the input's dtype."""
    return grad.matmul(weight.to(grad.dtype)).to(dtype)


def _weight_grads(ctx, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, with_bias: bool):
    """dW = dY^T X over every token, db = sum of dY, in the parameters' dtypes; None where not needed (dW also
    where `weight_grads` defers it)."""
    if not (ctx.needs_input_grad[1] or (with_bias and ctx.needs_input_grad[2])):
        return None, None
    flat = grad.reshape(-1, grad.shape[-1])
    grad_weight = weight_grad(lambda: flat.t().mm(x.reshape(-1, x.shape[-1]).to(grad.dtype)).to(weight.dtype),
                              weight) if ctx.needs_input_grad[1] else None  # now, or deferred (zero bubble)
    return grad_weight, flat.sum(0).to(weight.dtype) if with_bias else None


# when the backward waits for its collective (`wait_policy`, chosen once from overlap_comm)
def wait_after_next_gemm(pending: PendingCollective) -> PendingCollective:
    """overlap_comm=True: the backward waits for the collective after its next GEMM (Megatron's async dgrad)."""
    return pending


def wait_at_once(pending: PendingCollective) -> CompletedCollective:
    """overlap_comm=False: the same collective, waited for at once."""
    return CompletedCollective(pending.wait())


class _LocalLinear(torch.autograd.Function):
    """p = 1. Its own function rather than F.linear, which would keep a contiguous copy of a strided input (the
    attention's context) for backward: an [s, b, h] more per layer than at p > 1."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.with_bias, ctx.input_dtype = bias is not None, x.dtype
        return _gemm(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input = _input_grad(grad, weight, ctx.input_dtype) if ctx.needs_input_grad[0] else None
        return (grad_input, *_weight_grads(ctx, grad, x, weight, ctx.with_bias))


class _ColumnParallelLinear(torch.autograd.Function):
    """Y = X W_r^T + b_r; backward: dX = dY W_r, all-reduced while dW = dY^T X runs (when it waits: `wait_policy`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, wait_policy):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.wait_policy, ctx.with_bias, ctx.input_dtype = group, wait_policy, bias is not None, x.dtype
        return _gemm(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        pending = None
        if ctx.needs_input_grad[0]:
            grad_input = _input_grad(grad, weight, ctx.input_dtype)
            pending = ctx.wait_policy(all_reduce(grad_input, ctx.group, async_op=True))
        grad_weight, grad_bias = _weight_grads(ctx, grad, x, weight, ctx.with_bias)
        return (pending.wait() if pending is not None else None), grad_weight, grad_bias, None, None


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """X [s/p, b, in] all-gathered along s, then Y = X W_r^T + b_r. Only the local chunk is kept: the backward
    all-gathers it again while dX = dY W_r runs, then reduce-scatters dX while dW = dY^T X runs."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, wait_policy):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.wait_policy, ctx.with_bias, ctx.input_dtype = group, wait_policy, bias is not None, x.dtype
        return _gemm(all_gather_first_dim(x, group), weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gathering = ctx.wait_policy(all_gather_first_dim(x, ctx.group, async_op=True))
        grad_input = _input_grad(grad, weight, ctx.input_dtype) if ctx.needs_input_grad[0] else None  # meanwhile
        total = gathering.wait()
        pending = (ctx.wait_policy(reduce_scatter_first_dim(grad_input, ctx.group, async_op=True))
                   if grad_input is not None else None)
        grad_weight, grad_bias = _weight_grads(ctx, grad, total, weight, ctx.with_bias)
        return (pending.wait() if pending is not None else None), grad_weight, grad_bias, None, None


class _RowParallelLinear(torch.autograd.Function):
    """Y = sum over ranks of X_r W_r^T (all-reduce); backward: dX_r = dY W_r, dW_r = dY^T X_r, no collective."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.input_dtype = x.dtype
        return all_reduce(_gemm(x, weight), group)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input = _input_grad(grad, weight, ctx.input_dtype) if ctx.needs_input_grad[0] else None
        return grad_input, _weight_grads(ctx, grad, x, weight, False)[0], None


class _SequenceParallelRowLinear(torch.autograd.Function):
    """Y = the ranks' X_r W_r^T summed and reduce-scattered along s; backward: dY all-gathered along s first."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.input_dtype = group, x.dtype
        return reduce_scatter_first_dim(_gemm(x, weight), group)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = all_gather_first_dim(grad, ctx.group)
        grad_input = _input_grad(grad, weight, ctx.input_dtype) if ctx.needs_input_grad[0] else None
        return grad_input, _weight_grads(ctx, grad, x, weight, False)[0], None


def local_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The linear of a layer without communication (p = 1), differentiable once."""
    return _LocalLinear.apply(autocast_input(x), weight, bias)


def column_parallel_linear(x, weight, bias, group: ProcessGroup, wait_policy=wait_after_next_gemm) -> torch.Tensor:
    """[s, b, in] -> [s, b, out/p]: no collective forward, one all-reduce backward."""
    return _ColumnParallelLinear.apply(autocast_input(x), weight, bias, group, wait_policy)


def sequence_parallel_column_linear(x, weight, bias, group: ProcessGroup,
                                    wait_policy=wait_after_next_gemm) -> torch.Tensor:
    """[s/p, b, in] -> [s, b, out/p]: one all-gather forward; backward one all-gather and one reduce-scatter."""
    return _SequenceParallelColumnLinear.apply(autocast_input(x), weight, bias, group, wait_policy)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[s, b, in/p] -> [s, b, out], without the bias: one all-reduce forward, none backward."""
    return _RowParallelLinear.apply(autocast_input(x), weight, group)


def sequence_parallel_row_linear(x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[s, b, in/p] -> [s/p, b, out], without the bias: one reduce-scatter forward, one all-gather backward."""
    return _SequenceParallelRowLinear.apply(autocast_input(x), weight, group)
