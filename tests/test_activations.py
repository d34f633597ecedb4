"""SwiGLU's own backward (transformer/activations.py): the plain expression's forward and gradients bit for bit
(float32, bfloat16), a float64 gradcheck, the gradient written as one buffer (no backward of chunk), and what it
keeps for backward: the fused input and SiLU(gate), as autograd's graph did."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel_attention.transformer.activations import _SwiGLUFunction, swiglu


def _plain(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_float_operations_as_the_plain_expression(dtype):
    torch.manual_seed(0)  # awkward sizes: 2 f = 2 * 13 columns, a strided (batch-major) input
    y = (2 * torch.randn(3, 7, 26)).to(dtype).transpose(0, 1).requires_grad_()
    grad = torch.randn(7, 3, 13).to(dtype)
    ours = swiglu(y)
    (ours_grad,) = torch.autograd.grad(ours, y, grad)
    plain = _plain(y)
    (plain_grad,) = torch.autograd.grad(plain, y, grad)
    assert torch.equal(ours, plain) and torch.equal(ours_grad, plain_grad)


def test_gradients_are_exact_in_float64():
    y = torch.randn(4, 2, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_SwiGLUFunction.apply, (y,))


def test_keeps_the_input_and_the_activation_only():
    y = torch.randn(5, 2, 12, requires_grad=True)
    out = swiglu(y * 1.0)  # a non-leaf input, as fc_in's output is
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 2 and saved[0].shape == (5, 2, 12) and saved[1].shape == (5, 2, 6)
    assert torch.equal(saved[1], F.silu(y.detach()[..., :6]))


def test_compiles_as_one_graph_forward_and_backward():
    """model.compile: dynamo cannot trace `out=` into a strided half, so compiled code takes the plain expression."""
    import torch._dynamo as dynamo

    dynamo.reset()
    y = torch.randn(5, 2, 12, requires_grad=True)
    compiled = torch.compile(swiglu, backend="aot_eager", fullgraph=True)  # fullgraph: a break raises
    out = compiled(y * 1.0)
    (grad,) = torch.autograd.grad(out.sum(), y)
    (want,) = torch.autograd.grad(_plain(y * 1.0).sum(), y)
    assert torch.equal(out, _plain(y * 1.0)) and torch.equal(grad, want)
