"""MoELayer: a mixture of experts in place of a transformer layer's MLP.

    x [s, b, h]  (SP: this rank's [s/p, b, h]; CP: this rank's part of the sequence)
      | tokens [T, h] = x flattened
      | router (float32): top-k experts and gates per token            (router.py)
      | capacity mode: the slots past each expert's capacity dropped   (capacity.py)
      | dispatch to the experts (all-to-all over ep), combine          (dispatch.py, experts.py)
      | + shared expert (a ParallelMLP, optionally times sigmoid(x w_gate))
      | auxiliary losses over the micro-batch's counted tokens, attached to the output  (losses.py)
    y [s, b, h]  (the same layout as x)

Experts are not split by tensor parallelism: every tensor-parallel rank holds the same experts and runs them on
the tokens it holds (under SP its own, each rank's gradient then its share: PartialGrad, summed by finalize_grads).
Expert parallelism splits the E experts over the ep ranks of `ep_group`, a group folded over data x context
parallel ranks: each holds E/ep of them (global ids ep_rank E/ep ...), drawn from the full set so that the weights
are the one process's slice (`ExpertShard`).

Canonical names (relative to the layer, p- and ep-independent): `gate.weight` [E, h], `gate.e_score_correction_bias`
[E] (bias balancing), `experts.gate_up_proj` [E, 2f, h] and `experts.down_proj` [E, h, f] (SwiGLU; GELU: `experts.fc_in`
[E, f, h], `experts.fc_out` [E, h, f]), `shared_expert.*` (ParallelMLP's names), `shared_expert_gate.weight` [1, h].
"""

from __future__ import annotations

import torch
from torch import nn

from ...tensor_parallel.parallel_state import (ProcessGroup, get_data_context_parallel_group,
                                               get_expert_data_parallel_group, get_expert_model_parallel_group,
                                               group_rank, group_size)
from ...tensor_parallel.param_kinds import ExpertShard, PartialGrad, Replicated
from ..mlp import ParallelMLP
from .capacity import Dropless, TokenCapacity
from .counted_tokens import counted_tokens
from .dispatch import ExpertDispatch
from .experts import GroupedExperts
from .losses import RouterLosses, eager_attach_aux_loss
from .router import TopKRouter


def _no_shared_expert(x: torch.Tensor) -> None:
    return None


class MoELayer(nn.Module):
    def __init__(self, cfg, sequence_parallel: bool = False, tp_group: ProcessGroup | None = None,
                 cp_group: ProcessGroup | None = None, ep_group: ProcessGroup | None = None, device=None,
                 dtype: torch.dtype = torch.float32, layer_number: int = 0,
                 expert_data_group: ProcessGroup | None = None) -> None:
        """cfg: a ModelConfig with num_experts > 0. tp_group and cp_group as the caller resolved them (GPTModel);
        ep_group None: the default expert-parallel group (none before initialize_model_parallel), and its
        expert_data_group (the dp x cp ranks holding the same experts)."""
        super().__init__()
        eager_attach_aux_loss()  # made now, before a torch.compile could trace the forward that calls it
        if ep_group is None:
            ep_group, expert_data_group = get_expert_model_parallel_group(), get_expert_data_parallel_group()
        E, h, f = cfg.num_experts, cfg.hidden_size, cfg.resolved_moe_ffn_hidden_size()
        self.num_experts, self.hidden_size, self.ffn_hidden_size = E, h, f
        self.layer_number, self.ep_group, self.tp_group = layer_number, ep_group, tp_group
        self.ep_size = group_size(ep_group)
        if E % self.ep_size:
            raise ValueError(f"num_experts={E} is not divisible by expert_parallel_size={self.ep_size}.")
        self.dispatch = ExpertDispatch(E, ep_group)
        self.gate = TopKRouter(h, E, cfg.moe_top_k, cfg.moe_router_score, cfg.moe_router_renormalize,
                               cfg.moe_router_bias_update_rate, device, dtype)
        self.experts = GroupedExperts(self.dispatch.num_local, h, f, cfg.activation, device, dtype)
        self._probabilities = _per_token_share if cfg.moe_router_score == "sigmoid" else _as_probabilities
        self.shared_expert = self.shared_expert_gate = None
        self._shared = _no_shared_expert
        if cfg.moe_shared_expert_ffn_hidden_size:
            self.shared_expert = ParallelMLP(h, cfg.moe_shared_expert_ffn_hidden_size, cfg.activation, False,
                                             sequence_parallel, cfg.init_std, tp_group, device, dtype)
            self._shared = self._plain_shared_expert
            if cfg.moe_shared_expert_gate:
                self.shared_expert_gate = nn.Linear(h, 1, bias=False, device=device, dtype=dtype)
                self._shared = self._gated_shared_expert
        token_groups = (tp_group if sequence_parallel else None, cp_group)
        self.gate.count_groups = (get_data_context_parallel_group(), token_groups[0])  # the step's tokens: dp x cp
        self._capacities = (Dropless(E), Dropless(E) if cfg.moe_capacity_factor is None else TokenCapacity(
            cfg.moe_capacity_factor, E, token_groups, cp_group,
            *((group_size(tp_group), group_rank(tp_group)) if sequence_parallel else ())))  # (evaluation, training)
        self.capacity = self._capacities[1]
        self.losses = RouterLosses(E, cfg.moe_top_k, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff, token_groups,
                                   group_size(cp_group))
        self._replicated = PartialGrad(tp_group) if sequence_parallel else Replicated(tp_group)
        self._experts_kind = self._replicated if self.ep_size == 1 else ExpertShard(
            tp_group, ep_group, expert_data_group, self.ep_size * group_size(expert_data_group), sequence_parallel)
        self.load_canonical_state_dict(self._initial_canonical_weights(cfg.init_std))
        self.register_load_state_dict_pre_hook(_keep_this_ranks_experts)

    def train(self, mode: bool = True) -> MoELayer:
        """Capacity mode drops slots in training forwards only: evaluation and generation run dropless, so the
        validation loss (each dp rank holds a share of every validation batch) is one process's at every layout
        and cached decoding gives the full forward's logits (capacity.py)."""
        self.capacity = self._capacities[mode]
        return super().train(mode)

    def parameter_kinds(self) -> dict:
        kinds = {"gate.weight": self._replicated, f"experts.{self.experts.in_name}": self._experts_kind,
                 f"experts.{self.experts.out_name}": self._experts_kind}
        if self.gate.e_score_correction_bias is not None:
            kinds["gate.e_score_correction_bias"] = Replicated(self.tp_group)
        if self.shared_expert_gate is not None:
            kinds["shared_expert_gate.weight"] = self._replicated
        return kinds

    def active_paths(self) -> dict[str, str]:
        """Which implementation each part runs, and why (chosen once, at construction)."""
        return {"experts": self.experts.active_path(),
                "dispatch": f"all-to-all over {self.ep_size} ranks" if self.ep_size > 1 else "local (ep 1)"}

    def canonical_shapes(self) -> dict[str, tuple[int, ...]]:
        E, h, f = self.num_experts, self.hidden_size, self.ffn_hidden_size
        e = self.experts
        shapes = {"gate.weight": (E, h), f"experts.{e.in_name}": (E, 2 * f if e.gated else f, h),
                  f"experts.{e.out_name}": (E, h, f)}
        if self.gate.e_score_correction_bias is not None:
            shapes["gate.e_score_correction_bias"] = (E,)
        if self.shared_expert is not None:
            shapes.update({f"shared_expert.{k}": v for k, v in self.shared_expert.canonical_shapes().items()})
        if self.shared_expert_gate is not None:
            shapes["shared_expert_gate.weight"] = (1, h)
        return shapes

    def _initial_canonical_weights(self, std: float) -> dict[str, torch.Tensor]:
        """The whole layer's weights, drawn in one order at every layout (the shared expert drew its own)."""
        w = self.gate.weight
        sd = {}
        for name, shape in self.canonical_shapes().items():
            if name.startswith("shared_expert."):
                continue
            fill = torch.zeros if name.endswith("bias") else None
            sd[name] = fill(shape, device=w.device) if fill else torch.empty(shape, device=w.device,
                                                                             dtype=w.dtype).normal_(0.0, std)
        return sd

    def _local_experts(self, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.ep_size, dim=0)[self.dispatch.ep_rank]

    @torch.no_grad()
    def load_canonical_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load this layer's canonical weights (names as canonical_shapes; the shared expert's may be left out,
        keeping its own)."""
        e = self.experts
        self.gate.weight.copy_(sd["gate.weight"])
        if self.gate.e_score_correction_bias is not None:
            self.gate.e_score_correction_bias.copy_(sd["gate.e_score_correction_bias"])
        getattr(e, e.in_name).copy_(self._local_experts(sd[f"experts.{e.in_name}"]))
        getattr(e, e.out_name).copy_(self._local_experts(sd[f"experts.{e.out_name}"]))
        shared = {k[len("shared_expert."):]: v for k, v in sd.items() if k.startswith("shared_expert.")}
        if self.shared_expert is not None and shared:
            self.shared_expert.load_canonical_state_dict(shared)
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.weight.copy_(sd["shared_expert_gate.weight"])

    def _plain_shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_expert(x)

    def _gated_shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(x @ self.shared_expert_gate.weight.to(x.dtype).t())
        return self.shared_expert(x) * gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.gate(tokens)
        slots = self.capacity(routing.expert_ids, x.shape[0])
        y = self.dispatch(tokens, slots, routing.gates, self.experts).view_as(x)
        shared = self._shared(x)
        if shared is not None:
            y = y + shared
        if not (self.training and torch.is_grad_enabled()):  # evaluation and generation: no losses, no counts
            return y
        counts = slots.chosen.float()
        share, record = self.losses(routing.logits, self._probabilities(routing.scores), routing.expert_ids,
                                    counts, counted_tokens(), slots.dropped)
        self.gate.step_counts.add_(counts)  # this rank's: update_expert_bias sums them over the step's ranks
        return eager_attach_aux_loss()(y, share, record, self.layer_number)


def _keep_this_ranks_experts(layer: MoELayer, state_dict: dict, prefix: str, *_) -> None:
    """load_state_dict takes the experts whole (as checkpoints and canonical state dicts hold them, at any ep) or
    this rank's: whole ones are cut to this rank's rows (no communication)."""
    for name in (layer.experts.in_name, layer.experts.out_name):
        key = f"{prefix}experts.{name}"
        if key in state_dict and state_dict[key].shape[0] == layer.num_experts != layer.dispatch.num_local:
            state_dict[key] = layer._local_experts(state_dict[key]).contiguous()


def build_mlp(cfg, layer_number: int, sequence_parallel: bool, tp_group: ProcessGroup | None,
              cp_group: ProcessGroup | None, device, dtype: torch.dtype, overlap_comm: bool) -> nn.Module:
    """Layer `layer_number`'s MLP: a MoELayer where the config makes it one (ModelConfig.is_moe_layer), else the
    dense ParallelMLP."""
    if cfg.is_moe_layer(layer_number):
        return MoELayer(cfg, sequence_parallel, tp_group, cp_group, device=device, dtype=dtype,
                        layer_number=layer_number)
    return ParallelMLP(cfg.hidden_size, cfg.resolved_ffn_hidden_size(), cfg.activation, cfg.mlp_bias,
                       sequence_parallel, cfg.init_std, tp_group, device, dtype, overlap_comm)


def _as_probabilities(scores: torch.Tensor) -> torch.Tensor:
    return scores


def _per_token_share(scores: torch.Tensor) -> torch.Tensor:
    """Sigmoid scores as a distribution per token (DeepSeek-V3's balance loss normalises them so)."""
    return scores / scores.sum(dim=-1, keepdim=True)
