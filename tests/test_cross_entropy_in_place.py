"""vocab_parallel_cross_entropy_ (the model's loss): it overwrites the logits it is handed instead of allocating
a second [tokens, V/p] buffer, and computes bitwise the losses and gradients of vocab_parallel_cross_entropy,
with padded vocabulary columns and ignored labels, in float32 and from bfloat16 logits (upcast: the caller's
logits stay as they were). Across ranks the model's equivalence tests cover it (test_model.py)."""

from __future__ import annotations

import pytest
import torch

from parallel_attention.transformer.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_


def _loss_and_grads(function, x, w, target, vocab_size, dtype):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logits = (x @ w.t()).to(dtype)
    before = logits.detach().clone()
    loss = function(logits, target, vocab_size, None)
    (loss * torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)).sum().backward()  # not a uniform upstream grad
    return loss.detach(), x.grad, w.grad, torch.equal(logits.detach(), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_size", [37, 33])  # 33: four padded columns of the 37 the head computes
def test_in_place_equals_the_out_of_place_loss(dtype, vocab_size):
    torch.manual_seed(0)
    x, w = torch.randn(9, 2, 11), torch.randn(37, 11)
    target = torch.randint(0, vocab_size, (9, 2))
    target[3, 1] = -100  # ignored: loss 0, no gradient
    plain = _loss_and_grads(vocab_parallel_cross_entropy, x, w, target, vocab_size, dtype)
    ours = _loss_and_grads(vocab_parallel_cross_entropy_, x, w, target, vocab_size, dtype)
    for got, want in zip(ours[:3], plain[:3]):
        assert torch.equal(got, want)
    assert plain[3]  # the plain loss leaves its input alone
    assert ours[3] == (dtype != torch.float32)  # float32 logits are overwritten; a bfloat16 caller's are not
