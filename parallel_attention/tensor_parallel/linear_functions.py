"""The parallel linears' autograd functions: each GEMM fused with the collectives of its region.

Two autograd functions, one per kind of linear (`ColumnParallelLinearFunction`, `RowParallelLinearFunction`), so
that a layer's forward calls its function by name; what it communicates is an object the layer chooses once in
`__init__` (`layers.py`), one class per variant, none testing a flag, a device or an environment variable when
it runs. Shapes: `s` sequence, `b` batch, `in`/`out` features, `p` TP size.

    variant                              forward                          backward
    column, p = 1 (LocalColumn)          Y = X W^T + b                    dX = dY W; dW = dY^T X
    column, TensorParallelColumn         Y = X W_r^T + b_r                dX = dY W_r -> all-reduce, while dW runs
    column, SequenceParallelColumn       all-gather X along s, then Y     all-gather X again (async, while dX = dY W_r
                                         (keeps only this rank's X chunk)  runs), reduce-scatter dX (async, while dW runs)
    row, p = 1 (LocalRow)                Y = X W^T                        dX = dY W; dW = dY^T X
    row, TensorParallelRow               Y_r = X_r W_r^T -> all-reduce    dX_r = dY W_r; dW_r = dY^T X_r
    row, SequenceParallelRow             Y_r -> reduce-scatter along s    all-gather dY along s, then as above

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
from torch.autograd.function import once_differentiable

from .collectives import (CompletedCollective, PendingCollective, all_gather_first_dim, all_reduce,
                          reduce_scatter_first_dim)
from .linear_precision import FOLLOW_POLICY
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


def _input_grad(ctx, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dX = dY W (in this call's precision: `ctx.gemms`), in the input's dtype."""
    return ctx.gemms.input_grad(grad, weight).to(ctx.input_dtype)


def _weight_grads(ctx, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, with_bias: bool):
    """dW = dY^T X over every token (in this call's precision), db = sum of dY, in the parameters' dtypes; None
    where not needed (dW also where `weight_grads` defers it)."""
    if not (ctx.needs_input_grad[1] or (with_bias and ctx.needs_input_grad[2])):
        return None, None
    flat, gemms = grad.reshape(-1, grad.shape[-1]), ctx.gemms
    grad_weight = weight_grad(lambda: gemms.weight_grad(flat, x.reshape(-1, x.shape[-1]), weight).to(weight.dtype),
                              weight) if ctx.needs_input_grad[1] else None  # now, or deferred (zero bubble)
    return grad_weight, flat.sum(0).to(weight.dtype) if with_bias else None


# when the backward waits for its collective (`wait_policy`, chosen once from overlap_comm)
def wait_after_next_gemm(pending: PendingCollective) -> PendingCollective:
    """overlap_comm=True: the backward waits for the collective after its next GEMM (Megatron's async dgrad)."""
    return pending


def wait_at_once(pending: PendingCollective) -> CompletedCollective:
    """overlap_comm=False: the same collective, waited for at once."""
    return CompletedCollective(pending.wait())


class LocalColumn:
    """p = 1: a column-parallel linear without communication."""

    group = None  # no amax to share (FP8)

    def gather_input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_input_again(self, x: torch.Tensor) -> CompletedCollective:
        return CompletedCollective(x)

    def reduce_input_grad(self, grad_input: torch.Tensor) -> CompletedCollective:
        return CompletedCollective(grad_input)


class TensorParallelColumn(LocalColumn):
    """Every rank holds the whole X: dX is all-reduced (when the backward waits for it: `wait_policy`)."""

    def __init__(self, group: ProcessGroup, wait_policy) -> None:
        self.group, self.wait_policy = group, wait_policy

    def reduce_input_grad(self, grad_input: torch.Tensor):
        return self.wait_policy(all_reduce(grad_input, self.group, async_op=True))


class SequenceParallelColumn(TensorParallelColumn):
    """Each rank holds its [s/p, b, in] chunk of X: all-gathered for the GEMM, gathered again for dW (only the chunk
    is kept for backward), and dX reduce-scattered back to chunks."""

    def gather_input(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_first_dim(x, self.group)

    def gather_input_again(self, x: torch.Tensor):
        return self.wait_policy(all_gather_first_dim(x, self.group, async_op=True))

    def reduce_input_grad(self, grad_input: torch.Tensor):
        return self.wait_policy(reduce_scatter_first_dim(grad_input, self.group, async_op=True))


class LocalRow:
    """p = 1: a row-parallel linear without communication."""

    group = None

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def gather_output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return grad


class TensorParallelRow(LocalRow):
    """The ranks' partial products are all-reduced; dY is whole on every rank."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        return all_reduce(y, self.group)


class SequenceParallelRow(TensorParallelRow):
    """The ranks' partial products are reduce-scattered along s; dY is all-gathered along s first."""

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_first_dim(y, self.group)

    def gather_output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return all_gather_first_dim(grad, self.group)


class ColumnParallelLinearFunction(torch.autograd.Function):
    """Y = gather(X) W_r^T + b_r. Backward: X gathered again (nothing at p = 1 or without SP) while dX = dY W_r
    runs, then dX reduced (`comm`) while dW = dY^T X runs. Its own function at p = 1 too, rather than F.linear,
    which would keep a contiguous copy of a strided input (the attention's context) for backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, precision):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.with_bias, ctx.input_dtype = comm, bias is not None, x.dtype
        ctx.gemms = precision.column(comm.group)
        return _own_tensor(ctx.gemms.forward(comm.gather_input(x), weight, bias))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gathering = ctx.comm.gather_input_again(x)
        grad_input = _input_grad(ctx, grad, weight) if ctx.needs_input_grad[0] else None  # meanwhile
        total = gathering.wait()
        pending = ctx.comm.reduce_input_grad(grad_input) if grad_input is not None else None
        grad_weight, grad_bias = _weight_grads(ctx, grad, total, weight, ctx.with_bias)
        return (pending.wait() if pending is not None else None), grad_weight, grad_bias, None, None


class RowParallelLinearFunction(torch.autograd.Function):
    """Y = reduce(X_r W_r^T), without the bias; backward: dY gathered (under SP), dX_r = dY W_r, dW_r = dY^T X_r."""

    @staticmethod
    def forward(ctx, x, weight, comm, precision):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.input_dtype, ctx.gemms = comm, x.dtype, precision.row(comm.group)
        return comm.reduce_output(_own_tensor(ctx.gemms.forward(x, weight, None)))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = ctx.comm.gather_output_grad(grad)
        grad_input = _input_grad(ctx, grad, weight) if ctx.needs_input_grad[0] else None
        return grad_input, _weight_grads(ctx, grad, x, weight, False)[0], None, None


LOCAL_COLUMN, LOCAL_ROW = LocalColumn(), LocalRow()


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           comm: LocalColumn, precision=FOLLOW_POLICY) -> torch.Tensor:
    """A column-parallel linear communicating as `comm` says (LocalColumn, TensorParallelColumn or
    SequenceParallelColumn), X cast to the autocast dtype first, multiplying in `precision` (`linear_precision`:
    the policy's, or HIGH_PRECISION for an output layer)."""
    return ColumnParallelLinearFunction.apply(autocast_input(x), weight, bias, comm, precision)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, comm: LocalRow, precision=FOLLOW_POLICY) -> torch.Tensor:
    """A row-parallel linear without its bias, communicating as `comm` says (LocalRow, TensorParallelRow or
    SequenceParallelRow), X cast to the autocast dtype first, multiplying in `precision`."""
    return RowParallelLinearFunction.apply(autocast_input(x), weight, comm, precision)


def local_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The linear of a layer without communication (p = 1), differentiable once, in the policy's precision."""
    return column_parallel_linear(x, weight, bias, LOCAL_COLUMN)
