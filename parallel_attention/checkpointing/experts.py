"""Experts split over an expert-parallel group (MoE at ep > 1) in checkpoints: saved whole, under their global index.

A checkpoint's files are per tensor-parallel rank and pipeline stage, written by data-parallel rank 0; at ep > 1
that rank holds only E/ep experts of each MoE layer. So saving gathers every ExpertShard parameter, and its AdamW
moments, over the ep group (expert e at row e, as at ep = 1), and loading keeps this rank's rows of the whole
tensors: a checkpoint does not depend on ep, and any (tp, pp, ep) resumes any other (tp and pp through the
resharding that already handles them).
"""

from __future__ import annotations

import torch
from torch import nn

from ..tensor_parallel.collectives import all_gather_along_dim
from ..tensor_parallel.param_kinds import ExpertShard, parameter_kinds
from ..tensor_parallel.parallel_state import group_rank, group_size


def split_experts(model: nn.Module) -> dict[str, ExpertShard]:
    """The model's parameters split over more than one expert-parallel rank, by name."""
    return {name: kind for name, (_, kind) in parameter_kinds(model).items()
            if isinstance(kind, ExpertShard) and group_size(kind.ep_group) > 1}


def _optimizer_index(optimizer) -> dict[int, int]:
    """id(parameter) -> its index in the optimizer's state dict (numbered across the groups, as torch does)."""
    groups = optimizer.param_groups if optimizer is not None else []
    return {id(p): i for i, p in enumerate(p for group in groups for p in group["params"])}


@torch.no_grad()
def with_whole_experts(model: nn.Module, optimizer, weights: dict, packed: dict | None,
                       writer: bool) -> tuple[dict, dict | None]:
    """(weights, packed optimizer state) with each split expert parameter and its moments whole. A collective over
    each ep group: every rank calls it; only the writer's dicts change (the others are returned as they came)."""
    experts = split_experts(model)
    if not experts:
        return weights, packed
    params = dict(model.named_parameters())
    index = _optimizer_index(optimizer)
    for name, kind in experts.items():
        whole = all_gather_along_dim(params[name].detach(), 0, kind.ep_group)
        if writer:
            weights[name] = whole
        state = optimizer.state.get(params[name], {}) if optimizer is not None else {}
        for key in sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0):
            whole = all_gather_along_dim(state[key], 0, kind.ep_group)
            if writer and packed is not None:
                packed["state"][index[id(params[name])]][key] = whole
    return weights, packed


def whole_shapes(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each split expert parameter as an empty tensor of its whole shape (what a checkpoint holds), by name."""
    params = dict(model.named_parameters())
    return {name: params[name].new_empty((params[name].shape[0] * group_size(kind.ep_group),)
                                         + tuple(params[name].shape[1:]), device="meta")
            for name, kind in split_experts(model).items()}


def this_ranks_experts(model: nn.Module, weights: dict, optimizer=None, optim_state: dict | None = None) -> None:
    """Cut, in place, the whole expert tensors read from a checkpoint to this rank's experts (no communication):
    `weights` by parameter name, `optim_state` (an optimizer state dict) by the optimizer's parameter index."""
    experts = split_experts(model)
    if not experts:
        return

    def mine(tensor: torch.Tensor, kind: ExpertShard) -> torch.Tensor:
        return tensor.chunk(group_size(kind.ep_group))[group_rank(kind.ep_group)].contiguous()

    for name, kind in experts.items():
        if name in weights:
            weights[name] = mine(weights[name], kind)
    if optimizer is None or optim_state is None:
        return
    params, index = dict(model.named_parameters()), _optimizer_index(optimizer)
    for name, kind in experts.items():
        state = optim_state["state"].get(index[id(params[name])], {})
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = mine(value, kind)
