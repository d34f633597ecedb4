"""Random float64 weights and data for a ParallelSelfAttention test, drawn the same on every rank."""

from __future__ import annotations

import torch


def load_random_weights_and_data(module, g: torch.Generator, shape: tuple[int, int, int]):
    """Loads weights drawn from `g` into `module`; returns them (leaves that require grad, for the reference), then
    an input x [s, b, h] (requires grad) and an upstream gradient of the same shape, both drawn from `g` next."""
    weights = {k: torch.randn(v.shape, generator=g, dtype=torch.float64).requires_grad_()
               for k, v in module.canonical_state_dict().items()}
    module.load_canonical_state_dict({k: v.detach() for k, v in weights.items()})
    x = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(*shape, generator=g, dtype=torch.float64)
    return weights, x, upstream
