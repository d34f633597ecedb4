"""ParallelMLP: column-parallel up-projection, activation, row-parallel down-projection.

    x [s, b, h]                 (SP: [s/p, b, h])
      | fc_in: ColumnParallelLinear h -> f (SwiGLU: [gate_r | up_r] fused, 2f/p rows per rank)
      | GELU (tanh form, as GPT-2), or SiLU(gate) * up
      | fc_out: RowParallelLinear f -> h, input_is_parallel (fwd all-reduce; SP: reduce-scatter)
    y [s, b, h]                 (SP: [s/p, b, h])

Canonical (p-independent) names: `fc_in`, `fc_out` (GELU); `gate_proj`, `up_proj`, `down_proj` (SwiGLU).
"""

from __future__ import annotations

import torch
from torch import nn

from ..tensor_parallel import sharding
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.collectives import all_gather_along_dim
from ..tensor_parallel.linear_functions import OVERLAP_COMM
from ..tensor_parallel.parallel_state import ProcessGroup
from .activations import gelu_tanh, swiglu


class ParallelMLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "gelu", bias: bool = True,
                 sequence_parallel: bool = False, init_std: float = 0.02, tp_group: ProcessGroup | None = None,
                 device=None, dtype: torch.dtype = torch.float32, overlap_comm: bool = OVERLAP_COMM) -> None:
        super().__init__()
        if activation not in ("gelu", "swiglu"):
            raise ValueError(f"activation={activation!r} is unknown; choose gelu or swiglu.")
        self.hidden_size, self.ffn_hidden_size, self.activation = hidden_size, ffn_hidden_size, activation
        self.gated, self.init_std = activation == "swiglu", init_std
        common = dict(sequence_parallel=sequence_parallel, init_std=None, tp_group=tp_group, device=device,
                      dtype=dtype)
        self.fc_in = ColumnParallelLinear(hidden_size, ffn_hidden_size * (2 if self.gated else 1), bias=bias,
                                          overlap_comm=overlap_comm, **common)
        self.fc_out = RowParallelLinear(ffn_hidden_size, hidden_size, bias=bias, input_is_parallel=True, **common)
        self.tp_size, self.tp_rank = self.fc_in.tp_size, self.fc_in.tp_rank
        self._activation = swiglu if self.gated else gelu_tanh
        self.load_canonical_state_dict(self._initial_canonical_weights())

    def canonical_shapes(self) -> dict[str, tuple[int, ...]]:
        h, f = self.hidden_size, self.ffn_hidden_size
        names = ("gate_proj", "up_proj", "down_proj") if self.gated else ("fc_in", "fc_out")
        shapes = {f"{n}.weight": (f, h) for n in names[:-1]}
        shapes[f"{names[-1]}.weight"] = (h, f)
        if self.fc_in.bias is not None:
            shapes.update({f"{n}.bias": (f,) for n in names[:-1]})
            shapes[f"{names[-1]}.bias"] = (h,)
        return shapes

    def _initial_canonical_weights(self) -> dict[str, torch.Tensor]:
        w = self.fc_in.weight
        return {name: torch.empty(shape, device=w.device, dtype=w.dtype).normal_(0.0, self.init_std)
                if name.endswith("weight") else torch.zeros(shape, device=w.device, dtype=w.dtype)
                for name, shape in self.canonical_shapes().items()}

    @torch.no_grad()
    def load_canonical_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        sharding.check_canonical(sd, self.canonical_shapes(), "MLP canonical state dict")
        ins = ("gate_proj", "up_proj") if self.gated else ("fc_in",)
        out = "down_proj" if self.gated else "fc_out"
        p, rank = self.tp_size, self.tp_rank
        fc_in = (lambda kind: sharding.fuse_gated(*(sd[f"{n}.{kind}"] for n in ins), p, rank) if self.gated  # noqa: E731
                 else sharding.column_shard(sd[f"fc_in.{kind}"], p, rank))
        self.fc_in.weight.copy_(fc_in("weight"))
        self.fc_out.weight.copy_(sharding.row_shard(sd[f"{out}.weight"], p, rank))
        if self.fc_in.bias is not None:
            self.fc_in.bias.copy_(fc_in("bias"))
            self.fc_out.bias.copy_(sd[f"{out}.bias"])

    @torch.no_grad()
    def canonical_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights on every rank (a collective over the tensor-parallel group)."""
        group, p = self.fc_in.tp_group, self.tp_size

        def unfuse(local: torch.Tensor) -> list[torch.Tensor]:
            gathered = all_gather_along_dim(local, 0, group)
            return list(sharding.unfuse_gated(list(gathered.chunk(p, dim=0)))) if self.gated else [gathered]

        ins = ("gate_proj", "up_proj") if self.gated else ("fc_in",)
        out = "down_proj" if self.gated else "fc_out"
        sd = {f"{n}.weight": t for n, t in zip(ins, unfuse(self.fc_in.weight))}
        sd[f"{out}.weight"] = all_gather_along_dim(self.fc_out.weight, 1, group)
        if self.fc_in.bias is not None:
            sd.update({f"{n}.bias": t for n, t in zip(ins, unfuse(self.fc_in.bias))})
            sd[f"{out}.bias"] = self.fc_out.bias.detach().clone()
        return sd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self._activation(self.fc_in(x)))

