"""transformers MLPs made tensor parallel. Shapes: `b` batch, `s` sequence, `h` hidden, `f` intermediate, `p` TP.

    x [b, s, h]                                  (replicated)
      | ColumnParallelLinear: gate and up fused, one GEMM (Llama family; GPT-2: c_fc alone)
      |   forward identity, backward all-reduce dX
    [b, s, 2f/p] = [gate rows of r | up rows of r]  (sharding.fuse_gated)
      | act(gate) * up                            (GPT-2: act(c_fc))
    [b, s, f/p]
      | RowParallelLinear: forward all-reduce, backward identity; bias replicated, added after the sum
    y [b, s, h]
"""

from __future__ import annotations

import torch
from torch import nn

from ..tensor_parallel.collectives import all_gather_along_dim
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.parallel_state import group_rank, group_size
from ..tensor_parallel.sharding import column_shard, fuse_gated, row_shard, unfuse_gated


def _column(weight: torch.Tensor, bias: torch.Tensor | None, group) -> ColumnParallelLinear:
    """A column-parallel linear holding this rank's rows of the already fused, per-rank [out/p, in] weight."""
    p = group_size(group)
    layer = ColumnParallelLinear(weight.shape[1], weight.shape[0] * p, bias=bias is not None, init_std=None,
                                 tp_group=group, **device_dtype_of(weight))
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def _row(weight: torch.Tensor, bias: torch.Tensor | None, group) -> RowParallelLinear:
    """A row-parallel linear from the full [out, in] weight."""
    layer = RowParallelLinear(weight.shape[1], weight.shape[0], bias=bias is not None, input_is_parallel=True,
                              init_std=None, tp_group=group, **device_dtype_of(weight))
    with torch.no_grad():
        layer.weight.copy_(row_shard(weight, group_size(group), group_rank(group)))
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def device_dtype_of(weight: torch.Tensor) -> dict:
    """The device and dtype of transformers' weight, for the layer that takes its place (a bf16 model stays bf16)."""
    return dict(device=weight.device, dtype=weight.dtype)


def _gather_rows(t: torch.Tensor, group) -> list[torch.Tensor]:
    return list(all_gather_along_dim(t.detach(), 0, group).chunk(group_size(group), 0))


def _full_row(layer: RowParallelLinear) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = all_gather_along_dim(layer.weight.detach(), 1, layer.tp_group)
    return weight, (layer.bias.detach().clone() if layer.bias is not None else None)


class GatedMLP(nn.Module):
    """Llama, Mistral, Qwen2, Qwen3: down(act(gate(x)) * up(x)), gate and up in one column-parallel GEMM."""

    def __init__(self, old: nn.Module, group) -> None:
        super().__init__()
        p, rank = group_size(group), group_rank(group)
        bias = old.gate_proj.bias
        self.gate_up = _column(fuse_gated(old.gate_proj.weight.detach(), old.up_proj.weight.detach(), p, rank),
                               None if bias is None else fuse_gated(bias.detach(), old.up_proj.bias.detach(), p, rank),
                               group)
        self.down_proj = _row(old.down_proj.weight.detach(), _detached(old.down_proj.bias), group)
        self.act_fn = old.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights under transformers' names (a collective)."""
        group = self.gate_up.tp_group
        out = dict(zip(("gate_proj.weight", "up_proj.weight"), unfuse_gated(_gather_rows(self.gate_up.weight, group))))
        if self.gate_up.bias is not None:
            out.update(zip(("gate_proj.bias", "up_proj.bias"), unfuse_gated(_gather_rows(self.gate_up.bias, group))))
        weight, bias = _full_row(self.down_proj)
        out["down_proj.weight"] = weight
        if bias is not None:
            out["down_proj.bias"] = bias
        return out


class Conv1DMLP(nn.Module):
    """GPT-2: dropout(c_proj(act(c_fc(x)))), its Conv1D weights ([in, out]) held transposed as [out, in]."""

    def __init__(self, old: nn.Module, group) -> None:
        super().__init__()
        p, rank = group_size(group), group_rank(group)
        self.c_fc = _column(column_shard(old.c_fc.weight.detach().t(), p, rank),
                            column_shard(old.c_fc.bias.detach(), p, rank), group)
        self.c_proj = _row(old.c_proj.weight.detach().t(), old.c_proj.bias.detach(), group)
        self.act, self.dropout = old.act, old.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        group = self.c_fc.tp_group
        weight, bias = _full_row(self.c_proj)
        return {"c_fc.weight": torch.cat(_gather_rows(self.c_fc.weight, group)).t().contiguous(),
                "c_fc.bias": torch.cat(_gather_rows(self.c_fc.bias, group)),
                "c_proj.weight": weight.t().contiguous(), "c_proj.bias": bias}


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()
