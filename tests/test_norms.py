"""RMSNorm's hand-written backward: the gradients of the plain torch expression (float64 gradcheck, float32 and
bfloat16 against autograd), the same forward bit for bit, and only the normalised input and 1/rms saved."""

from __future__ import annotations

import pytest
import torch

from parallel_attention.transformer.norms import RMSNorm, _RMSNormFunction


def _plain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The expression RMSNorm computed before it had its own backward (autograd differentiates it)."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def test_gradients_are_exact_in_float64():
    x = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.empty(8, dtype=torch.float64).uniform_(0.5, 1.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: _RMSNormFunction.apply(x, w, 1e-5), (x, weight))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_matches_the_plain_expression(dtype, tolerance):
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (3 * torch.randn(16, 2, 64)).to(dtype).requires_grad_()
    grad = torch.randn(16, 2, 64).to(dtype)
    ours = norm(x)
    plain_x, plain_w = x.detach().clone().requires_grad_(), norm.weight.detach().clone().requires_grad_()
    plain = _plain(plain_x, plain_w, 1e-5)
    assert torch.equal(ours, plain)  # the same float operations forward
    ours.backward(grad)
    plain.backward(grad)
    for got, want in ((x.grad, plain_x.grad), (norm.weight.grad, plain_w.grad)):
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < tolerance


def test_saves_the_normalised_input_and_the_inverse_rms_only():
    norm = RMSNorm(64)
    x = torch.randn(16, 2, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm(x)
    activations = [t for t in saved if t is not norm.weight]
    assert sorted(t.numel() * t.element_size() for t in activations) == [4 * 16 * 2, 4 * 16 * 2 * 64]
