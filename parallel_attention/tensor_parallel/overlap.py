"""The parallel linears as single autograd functions, so that their communication overlaps compute.

Column-parallel (the entry region fused with the GEMM), backward with `overlap` (Megatron's async dgrad):

    dX = dY W                    -> launch its all-reduce (SP: reduce-scatter along s), async_op=True
    dW = dY^T X, db = sum dY     <- computed while the collective runs
    wait                         -> dX [s, b, in] (SP: [s/p, b, in])

Row-parallel (the GEMM fused with the exit region), forward in `chunks` pieces along s:

    Y_i = X_i W^T, i = 1..k      -> launch the all-reduce (SP: reduce-scatter) of Y_i, then GEMM i+1
    wait all, concatenate        -> Y [s, b, out] (SP: [s/p, b, out])

Both reduce the tensor their own GEMM just produced, in place: no defensive clone (the public region
functions of `collectives` keep theirs, for tensors that belong to a caller). The number of collectives
is the regions': one each way per column/row pair; the row's forward issues one per chunk (k), while
its backward stays one (SP: a single all-gather of dY).

On CUDA no stream handling of our own is needed: ProcessGroupNCCL runs an async collective on its own
stream after an event wait on the current one (where dX was computed), keeps dX alive until the work is
done, and work.wait() makes the current stream wait for NCCL's (the CPU does not block); the dW GEMM
enqueued in between runs meanwhile. (Megatron sets CUDA_DEVICE_MAX_CONNECTIONS=1 so that the collective's
kernel is scheduled first: a launch-order hint, not a correctness need.) On gloo the collective runs on
gloo's own thread while this one computes dW. The opt-in shared-memory sum (shm_all_reduce) posts dX at
launch and sums at wait(): a rank that runs ahead computes dW instead of waiting for the slower one.

Autocast: the forward GEMM runs under the caller's autocast; the backward casts the saved input and
weight to the gradient's dtype and each gradient back to its tensor's dtype, as autocast's casts would.
"""

from __future__ import annotations

import torch

from .collectives import _all_reduce, _gather_first_dim, _reduce_scatter_first_dim  # no autograd: used inside
from .gemm import input_grad, linear, weight_grads
from .parallel_state import ProcessGroup, group_size
from .sharding import check_sequence_split

# the default of every layer that takes overlap_comm (and of AttentionConfig, GPTModel, parallel.overlap_comm)
OVERLAP_COMM = True


class _ColumnParallelLinearFunction(torch.autograd.Function):
    """Y = X W^T + b on this rank's rows W; entry: identity (SP: all-gather X along s); backward as above."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel: bool, overlap: bool):
        total = _gather_first_dim(x, group) if sequence_parallel else x
        ctx.save_for_backward(total, weight)
        ctx.group, ctx.sequence_parallel, ctx.overlap = group, sequence_parallel, overlap
        ctx.with_bias, ctx.input_dtype = bias is not None, x.dtype
        return linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        total, weight = ctx.saved_tensors
        grad_input = pending = None
        if ctx.needs_input_grad[0]:  # dX is fresh: reduce it in place
            grad_input = input_grad(grad, weight).to(ctx.input_dtype)
            pending = (_reduce_scatter_first_dim(grad_input, ctx.group, async_op=True) if ctx.sequence_parallel
                       else _all_reduce(grad_input, ctx.group, async_op=True))
            if not ctx.overlap:  # the same collective, waited for before dW
                grad_input, pending = pending.wait(), None
        wants_weight = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        grad_weight, grad_bias = weight_grads(grad, total, weight, ctx.with_bias, wants_weight)
        if pending is not None:
            grad_input = pending.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: ProcessGroup,
                           sequence_parallel: bool, overlap: bool) -> torch.Tensor:
    """[s, b, in] (SP: [s/p, b, in]) -> [s, b, out/p]: one collective in backward (SP: also one in forward)."""
    return _ColumnParallelLinearFunction.apply(x, weight, bias, group, sequence_parallel, overlap)


def _chunks_of(x: torch.Tensor, blocks: int, chunks: int) -> list[torch.Tensor]:
    """x [s, ...] as `blocks` equal blocks along s, each cut in up to `chunks` pieces; piece i of every block
    together, as [blocks * n_i, ...]. blocks = p under SP: the reduce-scatter of piece i then hands rank r
    piece i of its own block, so that the pieces concatenated are its [s/p, ...] in order."""
    by_block = x.view(blocks, x.shape[0] // blocks, *x.shape[1:])
    return [piece for piece in by_block.tensor_split(chunks, dim=1) if piece.shape[1] > 0]


class _RowParallelLinearFunction(torch.autograd.Function):
    """Y = sum over ranks of X_r W_r^T (SP: reduce-scattered along s), in `chunks` overlapped pieces."""

    @staticmethod
    def forward(ctx, x, weight, group, sequence_parallel: bool, chunks: int):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sequence_parallel, ctx.input_dtype = group, sequence_parallel, x.dtype
        blocks = group_size(group) if sequence_parallel else 1
        check_sequence_split(x.shape[0], blocks)
        pending = []
        for piece in _chunks_of(x, blocks, chunks):  # the GEMM of piece i+1 runs while piece i is reduced
            y = linear(piece, weight).flatten(0, 1)
            pending.append(_reduce_scatter_first_dim(y, group, async_op=True) if sequence_parallel
                           else _all_reduce(y, group, async_op=True))
        done = [p.wait() for p in pending]
        return done[0] if len(done) == 1 else torch.cat(done)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if ctx.sequence_parallel:  # the backward of the reduce-scatter: dY of every token, one collective
            grad = _gather_first_dim(grad, ctx.group)
        grad_input = input_grad(grad, weight).to(ctx.input_dtype) if ctx.needs_input_grad[0] else None
        grad_weight, _ = weight_grads(grad, x, weight, False, ctx.needs_input_grad[1])
        return grad_input, grad_weight, None, None, None


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup, sequence_parallel: bool,
                        chunks: int) -> torch.Tensor:
    """[s, b, in/p] -> [s, b, out] (SP: [s/p, b, out]), without the bias.

    Forward: min(chunks, s) all-reduces (SP: min(chunks, s/p) reduce-scatters); backward: none (SP: one
    all-gather). chunks=1 is the plain layer with its collective in place."""
    return _RowParallelLinearFunction.apply(x, weight, group, sequence_parallel, chunks)
