"""The linears' GEMMs: Y = X W^T + b and dX = dY W through oneDNN's inner product on float32 CPU tensors.

Why: torch routes a float32 CPU linear to MKL's sgemm. On the AMD EPYC hosts this project is tested on, X W^T is
MKL's slowest form (the vocabulary projection: 45 GFLOP/s per core, against 62 for dY W), while oneDNN's inner
product runs it at 66. Over the benchmark model's shapes the forward takes 26 % less time and the input gradient
dY W (the same inner product with W^T) 4 % less; the weight gradient dY^T X is faster on MKL and stays there.
Measured with scripts/benchmark_gemm.py, in docs/benchmarks.md ("third pass"). torch's own inductor uses the same
operator (`torch.ops.mkldnn._linear_pointwise`) for CPU linears.

What stays the same:
- every row of Y depends on its own row of X only, bitwise (a batch or sequence split gives the same rows),
  and the result was bitwise the same at 1 and 2 threads here;
- float64, half precision, autocast, CUDA and tracing by torch.compile take torch's GEMM, as before;
- the operator is probed once, on fixed operands (no random draw): where it is missing or disagrees with
  F.linear, torch's GEMM is used throughout.

Set PARALLEL_ATTENTION_ONEDNN_LINEAR=0 to keep torch's GEMM (read once, at the first call); `torch_gemm_only()`
keeps it inside a block (scripts/benchmark_training.py times the step both ways).
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


@functools.cache
def onednn_linear_active() -> bool:
    """Whether float32 CPU linears go through oneDNN: available, not switched off, and agreeing with F.linear."""
    if os.environ.get("PARALLEL_ATTENTION_ONEDNN_LINEAR", "1") == "0" or not torch.backends.mkldnn.is_available():
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


_suspended = False  # set inside torch_gemm_only()


@contextlib.contextmanager
def torch_gemm_only():
    """Inside this block every linear takes torch's GEMM: for timing the two side by side in one process."""
    global _suspended
    saved, _suspended = _suspended, True
    try:
        yield
    finally:
        _suspended = saved


def _takes_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not _suspended and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and onednn_linear_active())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Y = X W^T + b, no autograd of its own: for the forward of an autograd function."""
    if _takes_onednn(x, weight):
        return onednn_inner_product(x, weight, bias)
    return F.linear(x, weight, bias)


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
    """The linear of a layer without communication (p = 1), differentiable: `linear` where it applies."""
    if _takes_onednn(x, weight):
        return _LinearFunction.apply(x, weight, bias)
    return F.linear(x, weight, bias)
