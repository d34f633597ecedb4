"""The p = 1 linear (tensor_parallel/linear_functions.local_linear): its own autograd function, exact against
F.linear, under autocast as F.linear, and its output may be overwritten in place by the loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel_attention.tensor_parallel import linear_functions
from parallel_attention.transformer.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_


def _operands(dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(37, 3, 29, generator=g, dtype=dtype), torch.randn(23, 29, generator=g, dtype=dtype),
            torch.randn(23, generator=g, dtype=dtype))


@pytest.mark.parametrize("with_bias, needs", [(True, (True, True, True)), (False, (True, True, False)),
                                               (True, (False, True, True)), (True, (True, False, False))])
def test_backward_is_exact(with_bias, needs):
    """float64 gradcheck, with and without a bias, and with an input or a weight that needs no gradient (frozen)."""
    x, w, b = _operands(torch.float64)
    args = [x[:4, :2].clone(), w[:5].clone(), b[:5].clone() if with_bias else None]
    for t, wants in zip(args, needs):
        if t is not None:
            t.requires_grad_(wants)
    assert torch.autograd.gradcheck(linear_functions.local_linear, tuple(args))


def test_float64_forward_is_f_linear_exactly():
    x, w, b = _operands(torch.float64)
    assert torch.equal(linear_functions.local_linear(x, w, b), F.linear(x, w, b))


def test_autocast_output_is_f_linears():
    x, w, b = _operands()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear_functions.local_linear(x, w, b)
        want = F.linear(x, w, b)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)


@pytest.mark.parametrize("with_bias", [False, True])
def test_the_output_may_be_overwritten_by_the_loss(with_bias):
    """The model's loss overwrites the logits in place: autograd forbids that on a custom function's view output
    (F.linear's with a bias is a reshape of its 2-D result)."""
    x, w, b = (t.requires_grad_() for t in _operands())
    b = b if with_bias else None
    target = torch.randint(0, 23, (37, 3))
    grads = []
    for loss in (vocab_parallel_cross_entropy_, vocab_parallel_cross_entropy):
        loss(linear_functions.local_linear(x, w, b), target, 23, None).sum().backward()
        grads.append([t.grad.clone() for t in (x, w, b) if t is not None])
        for t in (x, w, b):
            if t is not None:
                t.grad = None
    assert all(torch.equal(ours, plain) for ours, plain in zip(*grads))
