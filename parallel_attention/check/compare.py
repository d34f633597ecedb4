"""Dtype-aware comparison with the float64 reference, and gradients in canonical layout."""

from __future__ import annotations

import torch
from torch import nn

# Largest accepted error, relative to the reference tensor's largest magnitude. The reference sees
# the very inputs and weights the module holds (rounded to its dtype), so only the module's own
# rounding is measured: float32 ~1e-7 per operation over a few dozen accumulations (~1e-6 seen,
# 1e-4 leaves room for GPU kernels); float16 (eps 1e-3) and bfloat16 (eps 8e-3) a few ulps through
# two layers and their backward (seen on CPU: 3e-3 and 2e-2). A wrong layout or a missing reduction
# gives errors of order 1.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}


def relative_error(value: torch.Tensor, reference: torch.Tensor, scale: float = 0.0) -> float:
    """max |value - reference| / max(max |reference|, scale)."""
    value = value.detach().to(device="cpu", dtype=torch.float64)
    if value.shape != reference.shape:
        return float("inf")
    scale = reference.abs().max().clamp_min(max(scale, 1e-30))
    return float(((value - reference).abs().max() / scale).nan_to_num(float("inf")))


def grad_errors(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative errors of canonical gradients. A bias is measured against the larger of its own and its
    weight's gradient: k_proj.bias has a zero gradient in exact arithmetic (softmax ignores a shift
    shared by all keys), so only rounding noise of its weight's size is left to compare."""
    def scale(name: str) -> float:
        weight = reference.get(name[:-len("bias")] + "weight") if name.endswith(".bias") else None
        return 0.0 if weight is None else float(weight.abs().max())
    return {f"grad {k}": relative_error(grads[k], g, scale(k)) for k, g in reference.items()}


def verdict(errors: dict[str, float], dtype: torch.dtype, what: str) -> tuple[bool, str]:
    """(ok, detail) for the errors of `what` (name -> relative error)."""
    worst = max(errors, key=errors.get)
    tolerance = TOLERANCE[dtype]
    ok = errors[worst] <= tolerance
    bad = sorted(name for name, e in errors.items() if e > tolerance)
    shown = f"; over it: {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}" if bad else ""
    return ok, (f"{what}: max relative error {errors[worst]:.1e} ({worst}), "
                f"tolerance {tolerance:.0e}{shown}")


def representable(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` rounded to `dtype`, held in float64 on the CPU (so the reference sees what the module holds)."""
    return t.to(dtype).to(device="cpu", dtype=torch.float64)


def canonical_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients in canonical layout: swap them into the parameters and reuse the weight gathering
    (`canonical_state_dict`, a collective). Call after finalize_grads."""
    saved = {n: p.detach().clone() for n, p in module.named_parameters()}
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    grads = module.canonical_state_dict()
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(saved[n])
    return grads
