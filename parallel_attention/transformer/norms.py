"""LayerNorm and RMSNorm that know about sequence parallelism; apex fused kernels on CUDA when present; the q/k norms.

Under sequence parallelism a norm runs on this rank's [s/p, b, h] tokens with weights replicated
across the tensor-parallel group, so its gradient is a partial sum: the norm declares its
parameters PartialGrad, and finalize_grads() completes them.

The q/k norms (AttentionConfig.qk_norm_scope) come in two kinds:

    head        q [s, b, nhl, d] normalised over d, weight [d] shared by every head (Qwen3): HeadRMSNorm
    projection  q [s, b, nhl, d] normalised over all nh d values of the token's q projection (OLMoE), weight
                [nh d] sharded like the heads ([nhl d] here; k likewise, [nkv d], and when p > nkv each rank
                holds its k/v head's rows as it holds the head, a replica): ProjectionRMSNorm
                  fwd: local sums of squares of q and k [2, s, b] -> 1 all-reduce over tp -> 1/rms of the token
                  bwd: local sums of (g w) * x_hat of q and k [2, s, b] -> 1 all-reduce over tp
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import sharding
from ..tensor_parallel.collectives import all_gather_along_dim, all_reduce
from ..tensor_parallel.param_kinds import KvReplica, PartialGrad, Replicated, Sharded
from ..tensor_parallel.parallel_state import ProcessGroup, group_rank, group_size, resolve_tp_group
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

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the canonical weight: all of it (every rank holds the whole [d])."""
        return full

    def gathered(self) -> torch.Tensor:
        """The canonical weight (no collective)."""
        return self.weight.detach().clone()


class NoHeadNorm(nn.Module):
    """q and k as they are (no qk_norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ProjectionRMSNorm(nn.Module):
    """This rank's part of an RMSNorm over a whole q or k projection of `num_heads` heads (OLMoE's q_norm [nh d] and
    k_norm [nkv d]): the weight's rows of the heads this rank holds, as the projection's rows (`sharding.head_rows`):
    Sharded along 0, or when p > num_heads (k/v heads replicated) a KvReplica of its head, whose gradient each
    replica holds a share of. It normalises together with its partner, `normalize_projections`: one all-reduce
    for both. `width` counts each replica, as the all-reduced sum of squares does, so their ratio is exact."""

    def __init__(self, num_heads: int, head_dim: int, eps: float, tp_group, device=None,
                 dtype=torch.float32) -> None:
        super().__init__()
        self.num_heads, self.eps, self.tp_group = num_heads, eps, tp_group
        self.tp_size, self.tp_rank = group_size(tp_group), group_rank(tp_group)
        rows = len(sharding.kv_heads_of_rank(num_heads, self.tp_size, self.tp_rank)) * head_dim
        self.width = rows * self.tp_size
        self.weight = nn.Parameter(torch.ones(rows, device=device, dtype=dtype))

    def parameter_kinds(self) -> dict:
        if self.tp_size <= self.num_heads:
            return {"weight": Sharded(0, self.tp_group)}
        slot = sharding.kv_heads_of_rank(self.num_heads, self.tp_size, self.tp_rank)[0]
        return {"weight": KvReplica(self.tp_group, rows=slice(None), slot=slot, num_slots=self.num_heads)}

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        return sharding.head_rows(full, self.num_heads, self.tp_size, self.tp_rank)

    def gathered(self) -> torch.Tensor:
        """The canonical weight, one replica of each head's rows (a collective over the tensor-parallel group)."""
        shards = all_gather_along_dim(self.weight.detach(), 0, self.tp_group).chunk(self.tp_size)
        return sharding.head_rows_unshard(list(shards), self.num_heads)

    def extra_repr(self) -> str:
        return f"{self.num_heads} heads over {self.tp_size} rank(s), eps={self.eps}"


class _ProjectionRMSNormFunction(torch.autograd.Function):
    """q and k [s, b, n, d] each normalised over its whole projection (all heads of every rank), in one all-reduce
    forward and one backward; float32 statistics, as _RMSNormFunction. With x_hat = x / rms and g' = g w:
    dx = (g' - x_hat sum(g' x_hat) / width) / rms, the sum over every rank's part of the projection."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, widths, eps, group):
        xs = tuple(x.flatten(-2).to(torch.promote_types(x.dtype, torch.float32)) for x in (q, k))
        squares = all_reduce(torch.stack([x.pow(2).sum(-1) for x in xs]), group)  # [2, s, b], over the tp group
        rstds = tuple(torch.rsqrt(total / width + eps).unsqueeze(-1) for total, width in zip(squares, widths))
        normed = tuple((x32 * rstd).to(x.dtype) for x, x32, rstd in zip((q, k), xs, rstds))
        ctx.save_for_backward(*normed, *rstds, q_weight, k_weight)
        ctx.widths, ctx.group, ctx.shapes = widths, group, (q.shape, k.shape)
        return tuple((n * w.to(n.dtype)).view(shape) for n, w, shape in zip(normed, (q_weight, k_weight), ctx.shapes))

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        saved = ctx.saved_tensors
        normed, rstds, weights = saved[0:2], saved[2:4], saved[4:6]
        grads = tuple(g.flatten(-2) for g in (grad_q, grad_k))
        compute = rstds[0].dtype
        n32 = tuple(n.to(compute) for n in normed)
        g32 = tuple((g * w).to(compute) for g, w in zip(grads, weights))
        dots = all_reduce(torch.stack([(g * n).sum(-1) for g, n in zip(g32, n32)]), ctx.group)  # [2, s, b]
        out = []
        for g, n, rstd, dot, width, grad, shape in zip(g32, n32, rstds, dots, ctx.widths, grads, ctx.shapes):
            out.append(((g - n * (dot / width).unsqueeze(-1)) * rstd).to(grad.dtype).view(shape))
        grad_weights = tuple((g.to(compute) * n).sum(dim=tuple(range(g.dim() - 1))).to(w.dtype)
                             for g, n, w in zip(grads, n32, weights))
        return (*out, *grad_weights, None, None, None)


def normalize_projections(q: torch.Tensor, k: torch.Tensor, q_norm: ProjectionRMSNorm,
                          k_norm: ProjectionRMSNorm, weights: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [s, b, nhl, d] and k [s, b, nkvl, d] each normalised over its whole projection (one all-reduce). `weights`:
    the (q, k) weights in place of the norms' own, where an owner passes them through a collective first."""
    q_weight, k_weight = weights if weights is not None else (q_norm.weight, k_norm.weight)
    return _ProjectionRMSNormFunction.apply(q, k, q_weight, k_weight, (q_norm.width, k_norm.width),
                                            q_norm.eps, q_norm.tp_group)


def normalize_heads(q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module,
                    k_norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k each through its own per-head norm (or the identity)."""
    return q_norm(q), k_norm(k)


def build_qk_norms(config, tp_group, device):
    """(q_norm, k_norm, normalize) for AttentionConfig `config`: per head (or the identity without qk_norm), or over
    the whole projections, each rank holding the rows of its heads. Chosen once."""
    if not (config.qk_norm and config.qk_norm_scope == "projection"):
        d, on = config.head_dim, config.qk_norm
        norms = [HeadRMSNorm(d, config.qk_norm_eps, False, tp_group, device, config.params_dtype) if on
                 else NoHeadNorm() for _ in range(2)]
        return (*norms, normalize_heads)
    norms = [ProjectionRMSNorm(n, config.head_dim, config.qk_norm_eps, tp_group, device, config.params_dtype)
             for n in (config.num_heads, config.num_kv_heads)]
    return (*norms, normalize_projections)
