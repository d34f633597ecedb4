"""A transformers sparse MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) made tensor parallel by splitting every
expert's FFN dimension. Shapes: `t` tokens (b s), `h` hidden, `E` experts, `k` top-k, `I` expert FFN, `S` shared
expert FFN, `p` TP size.

    x [t, h]                                   (replicated)
      | router (transformers' own module, replicated: its recorded logits feed the aux loss unchanged)
      |   -> top-k weights [t, k], ids [t, k];  Qwen2-MoE: sigmoid(shared_expert_gate(x)) [t, 1]
      | x, weights, shared gate: ONE copy-to-region of [t, h + k (+1)]: forward identity, backward all-reduce
      | transformers' experts module on this rank's shard:
      |   gate_up_proj [E, 2I/p, h] = [gate rows of r | up rows of r] per expert, down_proj [E, h, I/p]
      | (+ Qwen2-MoE's shared expert: [gate | up] rows [2S/p, h], down columns [h, S/p], times its gate)
    partial y [t, h]                           (this rank's I/p of every expert, plus its S/p)
      | ONE reduce-from-region: forward all-reduce, backward identity
    y [t, h]

The router and the shared expert's gate sit outside the region: their gradients (and the aux loss's, computed by
transformers from the recorded logits on every rank alike) are complete and equal on every rank, so they stay
plain replicated parameters; the region's backward sums the partial gradients of x and of the routing weights.
"""

from __future__ import annotations

import torch
from torch import nn

from ..tensor_parallel.collectives import all_gather_along_dim
from ..tensor_parallel.linear_functions import local_linear
from ..tensor_parallel.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from ..tensor_parallel.param_kinds import Replicated, Sharded
from ..tensor_parallel.parallel_state import group_rank, group_size
from ..tensor_parallel.sharding import fuse_gated, unfuse_gated
from .tp_mlp import GatedMLP


def expert_gate_up_shard(gate_up: torch.Tensor, p: int, rank: int) -> torch.Tensor:
    """This rank's [E, 2I/p, h] of transformers' fused [E, 2I, h]: its rows of each expert's gate, then of its up."""
    gate, up = gate_up.movedim(1, 0).chunk(2)
    return fuse_gated(gate, up, p, rank).movedim(0, 1).contiguous()


def expert_gate_up_unshard(shards: list[torch.Tensor]) -> torch.Tensor:
    """The fused [E, 2I, h] from every rank's [E, 2I/p, h] (the inverse of expert_gate_up_shard)."""
    gate, up = unfuse_gated([shard.movedim(1, 0) for shard in shards])
    return torch.cat([gate, up]).movedim(0, 1).contiguous()


class SharedExpertMLP(GatedMLP):
    """Qwen2-MoE's shared expert inside the block's region: GatedMLP's shards (and its hf_state_dict), without
    its own collectives (the block enters and leaves the region once for the experts and it together)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = local_linear(x, self.gate_up.weight, self.gate_up.bias).chunk(2, dim=-1)
        return local_linear(self.act_fn(gate) * up, self.down_proj.weight)


class TensorParallelSparseMoe(nn.Module):
    """A sparse MoE block on this rank's slice of every expert (see the module docstring)."""

    def __init__(self, old: nn.Module, group) -> None:
        super().__init__()
        p, rank = group_size(group), group_rank(group)
        self.tp_group = group
        self.gate, self.experts = old.gate, old.experts  # the experts module computes on its shards as it is
        self.experts.gate_up_proj = nn.Parameter(expert_gate_up_shard(old.experts.gate_up_proj.detach(), p, rank))
        self.experts.down_proj = nn.Parameter(old.experts.down_proj.detach().chunk(p, dim=2)[rank].contiguous())
        shared = getattr(old, "shared_expert", None)
        if shared is not None:
            self.shared_expert, self.shared_expert_gate = SharedExpertMLP(shared, group), old.shared_expert_gate
        self._shared_gate = self._sigmoid_gate if shared is not None else _no_gate
        self._shared_output = self._gated_shared if shared is not None else _no_shared

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, ids = self.gate(x)
        x, weights, shared_gate = _enter_region((x, weights, self._shared_gate(x)), self.tp_group)
        partial = self.experts(x, ids, weights) + self._shared_output(x, shared_gate)
        return reduce_from_tensor_parallel_region(partial, self.tp_group).view(shape)

    def _sigmoid_gate(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x))

    def _gated_shared(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gate * self.shared_expert(x)

    def parameter_kinds(self) -> dict:
        """The experts' FFN dimension sharded; the router and the shared expert's gate replicated, complete after
        backward (outside the region). The shared expert declares its own (GatedMLP's linears)."""
        kinds = {"experts.gate_up_proj": Sharded(1, self.tp_group), "experts.down_proj": Sharded(2, self.tp_group)}
        kinds.update({f"{name}.weight": Replicated(self.tp_group) for name in ("gate", "shared_expert_gate")
                      if hasattr(self, name)})
        return kinds

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights under transformers' names (a collective)."""
        shards = all_gather_along_dim(self.experts.gate_up_proj.detach(), 1, self.tp_group)
        out = {"gate.weight": self.gate.weight.detach().clone(),
               "experts.gate_up_proj": expert_gate_up_unshard(list(shards.chunk(group_size(self.tp_group), 1))),
               "experts.down_proj": all_gather_along_dim(self.experts.down_proj.detach(), 2, self.tp_group)}
        if hasattr(self, "shared_expert"):
            out.update({f"shared_expert.{k}": v for k, v in self.shared_expert.hf_state_dict().items()})
            out["shared_expert_gate.weight"] = self.shared_expert_gate.weight.detach().clone()
        return out


def _enter_region(tensors: tuple, group) -> tuple:
    """`tensors` [t, *] through one copy-to-region (backward: one all-reduce of their gradients together), packed
    in their common dtype and returned in their own (float32 routing weights stay float32 in a bf16 model)."""
    common = tensors[0].dtype
    for t in tensors[1:]:
        common = torch.promote_types(common, t.dtype)
    packed = copy_to_tensor_parallel_region(torch.cat([t.to(common) for t in tensors], dim=-1), group)
    parts = packed.split([t.shape[-1] for t in tensors], dim=-1)
    return tuple(part.to(t.dtype) for part, t in zip(parts, tensors))


def _no_gate(x: torch.Tensor) -> torch.Tensor:
    """No shared expert: an empty [t, 0] column block (packs into the region for free)."""
    return x.new_empty(x.shape[0], 0)


def _no_shared(x: torch.Tensor, gate: torch.Tensor):
    return 0.0


def moe_or_dense(old: nn.Module, group) -> nn.Module:
    """A decoder layer's MLP of an MoE family: the sparse block split by expert FFN, a dense one (Qwen2-MoE's
    mlp_only_layers, decoder_sparse_step) as GatedMLP."""
    return TensorParallelSparseMoe(old, group) if hasattr(old, "experts") else GatedMLP(old, group)
