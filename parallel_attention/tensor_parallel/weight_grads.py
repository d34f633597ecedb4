"""When the parallel linears compute their weight gradient dW = dY^T X: at once (the default), or later, queued,
for the zero-bubble pipeline schedule, whose backward computes only the input gradients that the previous stage
waits for and fills its idle time with the weight gradients (Qi et al. 2023).

The policy is swapped by a context, as the collectives' hooks are: the autograd functions call `weight_grad` and
never test a mode. A deferred gradient is accumulated into the parameter's `.grad` when its queue runs; the
closure holds the saved input and the output gradient until then (the schedule's memory cost).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch


def _now(compute: Callable[[], torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    return compute()


_policy = _now


def weight_grad(compute: Callable[[], torch.Tensor], weight: torch.Tensor) -> torch.Tensor | None:
    """dW for autograd to accumulate (computed now), or None when deferred (queued; see `deferred_weight_grads`)."""
    return _policy(compute, weight)


@contextlib.contextmanager
def deferred_weight_grads(queue: list):
    """Inside: every parallel linear's backward appends its weight-gradient computation to `queue` instead of
    running it; `run_weight_grads(queue)` runs them later."""
    global _policy

    def defer(compute, weight):
        queue.append((compute, weight))
        return None

    previous, _policy = _policy, defer
    try:
        yield queue
    finally:
        _policy = previous


@torch.no_grad()
def run_weight_grads(queue: list) -> None:
    """Run the deferred weight gradients, accumulating each into its parameter's .grad, and empty the queue."""
    for compute, weight in queue:
        grad = compute()
        weight.grad = grad if weight.grad is None else weight.grad.add_(grad)
    queue.clear()
