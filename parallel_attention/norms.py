"""LayerNorm and RMSNorm that know about sequence parallelism; apex fused kernels on CUDA when present.

Under sequence parallelism a norm runs on this rank's [s/p, b, h] tokens with weights replicated
across the tensor-parallel group, so its gradient is a partial sum: `partial_grads()` lets
finalize_grads() complete it.
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F
from torch import nn

from .grads import PartialGrad
from .parallel_state import ProcessGroup, group_size, resolve_tp_group


@functools.lru_cache(maxsize=None)
def _apex_fused_norms():
    try:
        return importlib.import_module("apex.normalization.fused_layer_norm")
    except Exception:  # NVIDIA apex absent (or the unrelated PyPI `apex`)
        return None


class _Norm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool, tp_group: ProcessGroup | None,
                 bias: bool, device, dtype) -> None:
        super().__init__()
        self.hidden_size, self.eps, self.sequence_parallel = hidden_size, eps, sequence_parallel
        self.tp_group = resolve_tp_group(tp_group) if sequence_parallel else None
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype)) if bias else None

    def partial_grads(self) -> list[PartialGrad]:
        if not self.sequence_parallel or group_size(self.tp_group) == 1:
            return []
        return [PartialGrad(p, self.tp_group) for p in (self.weight, self.bias) if p is not None]

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class LayerNorm(_Norm):
    def __init__(self, hidden_size, eps=1e-5, sequence_parallel=False, tp_group=None, device=None,
                 dtype=torch.float32):
        super().__init__(hidden_size, eps, sequence_parallel, tp_group, True, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        apex = _apex_fused_norms() if x.is_cuda else None
        if apex is not None:
            return apex.fused_layer_norm_affine(x, self.weight, self.bias, (self.hidden_size,), self.eps)
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)


class RMSNorm(_Norm):
    def __init__(self, hidden_size, eps=1e-5, sequence_parallel=False, tp_group=None, device=None,
                 dtype=torch.float32):
        super().__init__(hidden_size, eps, sequence_parallel, tp_group, False, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        apex = _apex_fused_norms() if x.is_cuda else None
        if apex is not None and hasattr(apex, "fused_rms_norm_affine"):
            return apex.fused_rms_norm_affine(x, self.weight, (self.hidden_size,), self.eps)
        # float32 statistics for half inputs, as Llama does
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def build_norm(kind: str, hidden_size: int, eps: float, sequence_parallel: bool, tp_group, device, dtype):
    if kind == "layernorm":
        return LayerNorm(hidden_size, eps, sequence_parallel, tp_group, device, dtype)
    if kind == "rmsnorm":
        return RMSNorm(hidden_size, eps, sequence_parallel, tp_group, device, dtype)
    raise ValueError(f"unknown norm {kind!r}; choose layernorm or rmsnorm.")
