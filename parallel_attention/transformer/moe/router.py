"""The token-choice top-k router of an MoE layer, in float32 (or wider), identical on every rank.

    x [T, h] -> logits = x w^T [T, E] (float32) -> scores: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)
             -> choice: the k best of scores (+ the balancing bias, for the choice only), ties to the lowest id
             -> gates: the chosen scores, divided by their sum when renormalised

The tie-break is a stable sort, so equal scores pick the lowest expert id on every rank and layout (torch.topk
does not promise an order among equals). DeepSeek-V3's auxiliary-loss-free balancing keeps a per-expert bias
(`expert_bias`, a parameter without gradient so that checkpoints carry it) that steers the choice only; after
each step `update_expert_bias` moves it by `rate` against each expert's excess load, from the step's counts
summed over every rank that holds tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ...tensor_parallel.param_kinds import local_shard


class Routing(NamedTuple):
    logits: torch.Tensor  # [T, E], router dtype
    scores: torch.Tensor  # [T, E], softmax or sigmoid of logits
    expert_ids: torch.Tensor  # [T, k], int64, best first (ties: lowest id first)
    gates: torch.Tensor  # [T, k], router dtype: the weights of the chosen experts' outputs


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits, dim=-1)


def _renormalised(gates: torch.Tensor) -> torch.Tensor:
    return gates / gates.sum(dim=-1, keepdim=True)


def _as_chosen(gates: torch.Tensor) -> torch.Tensor:
    return gates


def top_k_lowest_id(values: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest values along the last dim, best first, equal values in increasing index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


class TopKRouter(nn.Module):
    """weight [E, h] (canonical `gate.weight`, as Mixtral and Qwen name it); `expert_bias` [E] float32 when
    bias balancing is on (canonical `gate.e_score_correction_bias`, DeepSeek-V3's name)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, score: str = "softmax",
                 renormalize: bool = True, bias_update_rate: float = 0.0, device=None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"moe_router_score={score!r} is unknown; choose softmax or sigmoid.")
        self.num_experts, self.top_k, self.bias_update_rate = num_experts, top_k, bias_update_rate
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        self.router_dtype = torch.promote_types(dtype, torch.float32)  # never below float32
        self._score = _softmax if score == "softmax" else torch.sigmoid
        self._gates = _renormalised if renormalize else _as_chosen
        self.e_score_correction_bias = None
        self._choice_scores = self._plain_scores
        if bias_update_rate > 0:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, device=device, dtype=torch.float32), requires_grad=False)
            self._choice_scores = self._biased_scores
        self.count_groups: tuple = ()  # where other tokens of the step live (the MoE layer sets them)
        # tokens per expert since the last bias update (training forwards only; not saved)
        self.register_buffer("step_counts", torch.zeros(num_experts, device=device, dtype=torch.float32),
                             persistent=False)

    def _plain_scores(self, scores: torch.Tensor) -> torch.Tensor:
        return scores

    def _biased_scores(self, scores: torch.Tensor) -> torch.Tensor:
        return scores + self.e_score_correction_bias.to(scores.dtype)

    def forward(self, x: torch.Tensor) -> Routing:
        """x [T, h] (any dtype) -> Routing, computed in self.router_dtype (autocast would round the logits to
        bf16 and move near-tie choices)."""
        with torch.autocast(x.device.type, enabled=False):
            logits = x.to(self.router_dtype) @ self.weight.to(self.router_dtype).t()
        scores = self._score(logits)
        with torch.no_grad():
            expert_ids = top_k_lowest_id(self._choice_scores(scores.detach()), self.top_k)
        return Routing(logits, scores, expert_ids, self._gates(scores.gather(-1, expert_ids)))

    @torch.no_grad()
    def update_bias(self, global_counts: torch.Tensor) -> None:
        """DeepSeek-V3: bias_i += rate * sign(mean load - load_i), from the step's counts over all tokens."""
        if self.e_score_correction_bias is None:
            return
        step = torch.sign(global_counts.mean() - global_counts) * self.bias_update_rate
        mine, first = local_shard(self.e_score_correction_bias)  # FSDP2: this rank's rows of it
        mine.add_(step[first:first + mine.shape[0]].to(mine.dtype))
