"""The fused-QKV baselines of benchmarks/benchmark_attention.py: DTensor TP and fairscale, one QKV GEMM each.

Both project q, k and v with one [(nh + 2 nkv) d, h] weight whose rows are in the per-group layout
(for each k/v head g: [q heads of g | k_g | v_g]; checkpoint format 1's, `sharding.grouped_to_blocked_qkv`), so that an even split of the rows over p
ranks keeps whole query groups on each rank (needs nkv % p == 0). Shapes: s sequence, b batch, h hidden,
p TP size, nh heads, nkv k/v heads, d head dim, qpg = nh / nkv queries per group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module


def per_group_rows(weights: dict[str, torch.Tensor], nh: int, nkv: int, kind: str = "weight") -> torch.Tensor:
    """The full fused QKV weight (or bias) from canonical q/k/v_proj: [q_g | k_g | v_g] for g = 0 .. nkv-1."""
    q, k, v = (weights[f"{n}.{kind}"] for n in ("q_proj", "k_proj", "v_proj"))
    qs, ks, vs = q.chunk(nkv, 0), k.chunk(nkv, 0), v.chunk(nkv, 0)  # q: qpg heads per group
    return torch.cat([t for g in range(nkv) for t in (qs[g], ks[g], vs[g])])


def _attend(mixed: torch.Tensor, qpg: int, d: int, layout: str) -> torch.Tensor:
    """mixed [s, b, G (qpg + 2) d] ('sbh') or [b, s, ...] ('bsh'), G local groups -> context, same layout."""
    n0, n1 = mixed.shape[:2]
    q, k, v = mixed.view(n0, n1, -1, qpg + 2, d).split([qpg, 1, 1], dim=3)
    q, k, v = q.reshape(n0, n1, -1, d), k.squeeze(3), v.squeeze(3)
    order = (1, 2, 0, 3) if layout == "sbh" else (0, 2, 1, 3)  # -> [b, heads, s, d]
    q, k, v = (t.permute(*order) for t in (q, k, v))
    context = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=qpg > 1)
    back = (2, 0, 1, 3) if layout == "sbh" else (0, 2, 1, 3)
    return context.permute(*back).reshape(n0, n1, -1)


class FusedPlainAttention(nn.Module):
    """x [s, b, h] -> one fused qkv projection (per-group rows) -> causal SDPA -> o_proj -> [s, b, h].

    The number of local groups is read from the projection's output, so the same forward runs unsharded
    and under DTensor TP."""

    def __init__(self, weights: dict, nh: int, nkv: int, d: int, bias: bool, device, dtype) -> None:
        super().__init__()
        h = weights["o_proj.weight"].shape[0]
        self.qpg, self.d = nh // nkv, d
        self.qkv = nn.Linear(h, (nh + 2 * nkv) * d, bias=bias, device=device, dtype=dtype)
        self.o_proj = nn.Linear(nh * d, h, bias=bias, device=device, dtype=dtype)
        with torch.no_grad():
            self.qkv.weight.copy_(per_group_rows(weights, nh, nkv))
            self.o_proj.weight.copy_(weights["o_proj.weight"])
            if bias:
                self.qkv.bias.copy_(per_group_rows(weights, nh, nkv, "bias"))
                self.o_proj.bias.copy_(weights["o_proj.bias"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(_attend(self.qkv(x), self.qpg, self.d, "sbh"))


def torch_tp_fused(module: FusedPlainAttention, device_type: str, world: int) -> nn.Module:
    """Shard `module` in place: qkv colwise (an even row split = whole groups), o_proj rowwise.

    The root's input is a replicated DTensor (PrepareModuleInput), as in `torch_tp`."""
    mesh = init_device_mesh(device_type, (world,))
    plan = {"": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                   use_local_output=False),
            "qkv": ColwiseParallel(), "o_proj": RowwiseParallel()}
    return parallelize_module(module, mesh, plan)


class FairscaleAttention(nn.Module):
    """fairscale 0.4.13's ColumnParallelLinear (fused qkv, per-group rows) and RowParallelLinear around SDPA,
    batch-first: x [b, s, h] -> [b, s, h], as fairscale's own models (and its Megatron port) run it."""

    def __init__(self, weights: dict, nh: int, nkv: int, d: int, bias: bool, p: int, rank: int, dtype) -> None:
        super().__init__()
        from fairscale.nn.model_parallel import layers

        h = weights["o_proj.weight"].shape[0]
        self.qpg, self.d = nh // nkv, d
        self.qkv = layers.ColumnParallelLinear(h, (nh + 2 * nkv) * d, bias=bias, gather_output=False)
        self.dense = layers.RowParallelLinear(nh * d, h, bias=bias, input_is_parallel=True)
        self.to(dtype=dtype, device=weights["o_proj.weight"].device)
        with torch.no_grad():
            self.qkv.weight.copy_(per_group_rows(weights, nh, nkv).chunk(p, 0)[rank])
            self.dense.weight.copy_(weights["o_proj.weight"].chunk(p, 1)[rank])
            if bias:
                self.qkv.bias.copy_(per_group_rows(weights, nh, nkv, "bias").chunk(p, 0)[rank])
                self.dense.bias.copy_(weights["o_proj.bias"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(_attend(self.qkv(x), self.qpg, self.d, "bsh"))


def fairscale_attention(weights: dict, nh: int, nkv: int, d: int, bias: bool, p: int, rank: int, dtype):
    """FairscaleAttention on fairscale's own model-parallel group (created once, over every rank), or the
    reason it cannot run."""
    try:
        from fairscale.nn.model_parallel import initialize
    except ImportError as error:
        return None, f"fairscale is not installed ({error}): pip install -e '.[bench]'"
    if not initialize.model_parallel_is_initialized():
        initialize.initialize_model_parallel(p)
    return FairscaleAttention(weights, nh, nkv, d, bias, p, rank, dtype), None
