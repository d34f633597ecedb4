"""The linears' GEMMs: torch's (MKL on CPU) by default; oneDNN's inner product for Y = X W^T + b and dX = dY W
on float32 CPU tensors where PARALLEL_ATTENTION_ONEDNN_LINEAR=1.

Which is faster depends on the host, so the default is the one every peer uses and the other is kept one switch
away, timed beside it by scripts/benchmark_training.py (`ours_onednn_gemm`, or `ours_torch_gemm` when oneDNN is
on) and per shape by scripts/benchmark_gemm.py. On the AMD EPYC host of 2026-11-30 oneDNN took 5 % off the p = 1
training step (X W^T was MKL's slowest form there: 45 GFLOP/s for the vocabulary projection against oneDNN's 66);
on the host of 2026-12-01 it added 6 % at p = 1 and at p = 2 (its dY W 20 % slower than MKL's, its forward 3 % slower
in the step). docs/benchmarks.md has both. torch's inductor uses the same operator
(`torch.ops.mkldnn._linear_pointwise`) for CPU linears.

What oneDNN keeps when on:
- every row of Y depends on its own row of X only, bitwise (a batch or sequence split gives the same rows),
  and the result was bitwise the same at 1 and 2 threads here;
- float64, half precision, autocast, CUDA and tracing by torch.compile take torch's GEMM;
- the operator is probed once, on fixed operands (no random draw): where it is missing or disagrees with
  F.linear, torch's GEMM is used throughout.
The switch is read once, at the first call; a run resumed bit-exactly must keep the setting it began with (the
two round the last bit differently). `torch_gemm_only()` and `onednn_gemm()` pick one inside a block.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def onednn_inner_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """X W^T + b on oneDNN's operator, whatever the tensors (the dispatch below decides when it applies)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _own_tensor(y: torch.Tensor) -> torch.Tensor:
    """y, or where y is a reshape of a GEMM's 2-D result (oneDNN's N-D output; F.linear's with a bias), the same
    memory as a tensor of its own (`_unsafe_view`, the reshape torch's matmul uses): autograd forbids overwriting
    a custom function's view output in place, and the model's loss overwrites the logits."""
    return y if y._base is None else torch.ops.aten._unsafe_view(y._base, y.shape)


@functools.cache
def onednn_available() -> bool:
    """Whether oneDNN's inner product runs here and agrees with F.linear (probed once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        # fixed operands, no random draw: the probe runs inside the first forward, and must not move the
        # generators that dropout and resume depend on
        x = torch.linspace(-2.0, 2.0, 5 * 3 * 24).sin().view(5, 3, 24)
        w, b = torch.linspace(-1.0, 1.0, 7 * 24).cos().view(7, 24), torch.linspace(-0.5, 0.5, 7)
        y = onednn_inner_product(x, w, b)
    except (AttributeError, RuntimeError):  # an older or newer torch without the operator
        return False
    return y.shape == (5, 3, 7) and torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@functools.cache
def onednn_linear_active() -> bool:
    """Whether float32 CPU linears go through oneDNN: asked for (PARALLEL_ATTENTION_ONEDNN_LINEAR=1) and available."""
    return os.environ.get("PARALLEL_ATTENTION_ONEDNN_LINEAR", "0") == "1" and onednn_available()


_forced: str | None = None  # "torch" inside torch_gemm_only(), "onednn" inside onednn_gemm()


@contextlib.contextmanager
def _forcing(kind: str):
    global _forced
    saved, _forced = _forced, kind
    try:
        yield
    finally:
        _forced = saved


def torch_gemm_only():
    """Inside this block every linear takes torch's GEMM: for timing the two side by side in one process."""
    return _forcing("torch")


def onednn_gemm():
    """Inside this block float32 CPU linears take oneDNN's inner product where it is available, whatever the
    switch says: for timing the two side by side in one process."""
    return _forcing("onednn")


def _plain_float32_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """float32 operands on CPU, outside autocast and compilation: where oneDNN may apply, and where the p = 1
    linear runs its own autograd function."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling())


def _takes_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if _forced == "torch" or not _plain_float32_cpu(x, weight):
        return False
    return onednn_available() if _forced == "onednn" else onednn_linear_active()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Y = X W^T + b, no autograd of its own: for the forward of an autograd function."""
    if _takes_onednn(x, weight):
        return _own_tensor(onednn_inner_product(x, weight, bias))
    return _own_tensor(F.linear(x, weight, bias))


def input_grad(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dX = dY W in dY's dtype, no autograd: `linear` with W^T."""
    weight = weight.to(grad.dtype)
    if _takes_onednn(grad, weight):
        return onednn_inner_product(grad, weight.t())
    return grad.matmul(weight)


def weight_grads(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, with_bias: bool, needs: bool):
    """dW = dY^T X over every token, db = sum of dY (None where not wanted), in the parameters' dtypes."""
    if not needs:
        return None, None
    flat = grad.reshape(-1, grad.shape[-1])
    grad_weight = flat.t().mm(x.reshape(-1, x.shape[-1]).to(grad.dtype)).to(weight.dtype)
    return grad_weight, flat.sum(0).to(weight.dtype) if with_bias else None


class _LinearFunction(torch.autograd.Function):
    """Y = X W^T + b through `linear`; backward: dX = dY W through `input_grad`, dW = dY^T X on torch's GEMM.
    Differentiable once (as the tensor-parallel layers' functions are): no double backward."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.with_bias = bias is not None
        return linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input = input_grad(grad, weight).to(x.dtype) if ctx.needs_input_grad[0] else None
        wants_weight = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        grad_weight, grad_bias = weight_grads(grad, x, weight, ctx.with_bias, wants_weight)
        return grad_input, grad_weight, grad_bias


def local_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The linear of a layer without communication (p = 1), differentiable. On float32 CPU tensors its own function
    (`linear`, whichever GEMM that takes), which keeps the input for backward as it is given: F.linear would keep a
    contiguous copy of a strided 3-D input (the attention's context), an [s, b, h] more per layer than at p > 1."""
    if _plain_float32_cpu(x, weight):
        return _LinearFunction.apply(x, weight, bias)
    return F.linear(x, weight, bias)
