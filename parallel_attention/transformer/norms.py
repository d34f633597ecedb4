"""LayerNorm and RMSNorm that know about sequence parallelism; apex fused kernels on CUDA when present.

Under sequence parallelism a norm runs on this rank's [s/p, b, h] tokens with weights replicated
across the tensor-parallel group, so its gradient is a partial sum: the norm declares its
parameters PartialGrad, and finalize_grads() completes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel.param_kinds import PartialGrad, Replicated
from ..tensor_parallel.parallel_state import ProcessGroup, resolve_tp_group
from .kernels.apex_kernels import fused_norms_module


class _Norm(nn.Module):
    has_bias = True

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 tp_group: ProcessGroup | None = None, device=None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.hidden_size, self.eps, self.sequence_parallel = hidden_size, eps, sequence_parallel
        self.tp_group = resolve_tp_group(tp_group)
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype)) if self.has_bias else None

    def parameter_kinds(self) -> dict:
        kind = PartialGrad(self.tp_group) if self.sequence_parallel else Replicated(self.tp_group)
        return {name: kind for name, _ in self.named_parameters(recurse=False)}

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class LayerNorm(_Norm):

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        apex = fused_norms_module() if x.is_cuda else None
        if apex is not None:
            return apex.fused_layer_norm_affine(x, self.weight, self.bias, (self.hidden_size,), self.eps)
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)


class _RMSNormFunction(torch.autograd.Function):
    """y = x / rms(x) * w with a hand-written backward: saves the normalised input and the float32 1/rms only (not
    also the input), and runs half the passes of autograd's six-op graph (4.8 vs 9.7 ms fwd+bwd at [512, 2, 512]
    on one CPU core). The forward's float operations are those of the plain torch expression, bit for bit.
    y keeps x's dtype, as apex's mixed-dtype kernel does: under autocast, bf16 q or k with the float32 weight of a
    head norm stay bf16 (promoted to float32 they would leave the attention's half-precision paths); the weight's
    gradient is still summed in float32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # float32 statistics for half inputs, as Llama does (float64 stays float64)
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        normed = (x32 * rstd).to(x.dtype)
        ctx.save_for_backward(normed, rstd, weight)
        return normed * weight.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        normed, rstd, weight = ctx.saved_tensors
        compute = rstd.dtype
        g32, n32 = (grad * weight).to(compute), normed.to(compute)
        grad_weight = (grad.to(compute) * n32).sum(dim=tuple(range(grad.dim() - 1)))
        # d/dx of x * rstd(x), applied to g: rstd * (g - x_hat * mean(g * x_hat))
        grad_x = g32.sub_(n32 * (g32 * n32).mean(-1, keepdim=True)).mul_(rstd)
        return grad_x.to(grad.dtype), grad_weight.to(weight.dtype), None


class RMSNorm(_Norm):
    has_bias = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        apex = fused_norms_module() if x.is_cuda else None
        if apex is not None and hasattr(apex, "fused_rms_norm_affine"):
            return apex.fused_rms_norm_affine(x, self.weight, (self.hidden_size,), self.eps)
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def build_norm(kind: str, hidden_size: int, eps: float, sequence_parallel: bool, tp_group, device, dtype):
    if kind == "layernorm":
        return LayerNorm(hidden_size, eps, sequence_parallel, tp_group, device, dtype)
    if kind == "rmsnorm":
        return RMSNorm(hidden_size, eps, sequence_parallel, tp_group, device, dtype)
    raise ValueError(f"unknown norm {kind!r}; choose layernorm or rmsnorm.")


class HeadRMSNorm(RMSNorm):
    """RMSNorm over the head dim of q or k [..., heads, d] (Qwen3's q_norm / k_norm): one weight [d] shared by
    every head, the project's one per-head norm (GPTModel's attention and `hf.parallelize`'s Qwen3 attention).
    Each rank normalises only its own heads, so the gradient of the replicated weight is a partial sum across
    the tensor-parallel group (with or without sequence parallelism): PartialGrad, completed by finalize_grads()
    unless the owner completes it in its backward (`normalize` with a weight that went through a collective)."""

    def normalize(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x normalised and scaled by `weight` (this norm's own, or one an owner passed through a collective)."""
        return _RMSNormFunction.apply(x, weight, self.eps)

    def parameter_kinds(self) -> dict:
        return {"weight": PartialGrad(self.tp_group)}


class NoHeadNorm(nn.Module):
    """q and k as they are (no qk_norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def build_head_norm(enabled: bool, head_dim: int, eps: float, tp_group, device, dtype) -> nn.Module:
    """HeadRMSNorm when `enabled` (AttentionConfig.qk_norm), else the identity: chosen once, in __init__."""
    return HeadRMSNorm(head_dim, eps, False, tp_group, device, dtype) if enabled else NoHeadNorm()
