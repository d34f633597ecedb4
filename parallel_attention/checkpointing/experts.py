"""Experts split over an expert-parallel group (MoE at ep > 1) in checkpoints: saved whole, under their global index.

A checkpoint's files are per tensor-parallel rank and pipeline stage, written by data-parallel rank 0; at ep > 1
that rank holds only E/ep experts of each MoE layer. So saving gathers every ExpertShard parameter, and its AdamW
moments, over the ep group (expert e at row e, as at ep = 1), and loading keeps this rank's rows of the whole
tensors (`this_ranks_experts`): a checkpoint does not depend on ep, and any (tp, pp, ep) resumes any other (tp and
pp through the resharding that already handles them). Under FSDP2 (zero_stage 3) the experts are DTensors over the
ranks that hold the same ones: gathered over those first, and this rank's rows cut again like them on load.
"""

from __future__ import annotations

import torch
from torch import nn

from ..tensor_parallel.expert_shards import split_experts, this_ranks_rows, whole
from ..tensor_parallel.parallel_state import group_size
from .state_encoding import full_optimizer_state, gathered, placed_like


def _optimizer_index(optimizer) -> dict[int, int]:
    """id(parameter) -> its index in the optimizer's state dict (numbered across the groups, as torch does)."""
    groups = optimizer.param_groups if optimizer is not None else []
    return {id(p): i for i, p in enumerate(p for group in groups for p in group["params"])}


def whole_state(model: nn.Module, optimizer, writer: bool) -> tuple[dict, dict | None]:
    """(model state dict, packed optimizer state) as a checkpoint holds them, on the writer (data-parallel rank 0):
    a sharded optimizer consolidated, FSDP2's data-parallel shards and split experts made whole. Collectives: every
    rank calls it."""
    packed = full_optimizer_state(optimizer, writer) if optimizer is not None else None
    weights = gathered(model.state_dict(), writer)
    return with_whole_experts(model, optimizer, weights, packed, writer)


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
        experts_whole = whole(params[name], kind)
        if writer:
            weights[name] = experts_whole
        state = optimizer.state.get(params[name], {}) if optimizer is not None else {}
        for key in sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0):
            moment = whole(state[key], kind)
            if writer and packed is not None:
                packed["state"][index[id(params[name])]][key] = moment
    return weights, packed


def whole_shapes(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each split expert parameter as an empty tensor of its whole shape (what a checkpoint holds), by name."""
    params = dict(model.named_parameters())
    return {name: params[name].new_empty((params[name].shape[0] * group_size(kind.ep_group),)
                                         + tuple(params[name].shape[1:]), device="meta")
            for name, kind in split_experts(model).items()}


def this_ranks_experts(model: nn.Module, optimizer=None, optim_state: dict | None = None,
                       weights: dict | None = None) -> None:
    """Cut, in place, the whole experts of the `weights` read from a checkpoint and their moments in an optimizer
    state dict (by the optimizer's parameter index) to this rank's experts, no communication; under FSDP2 the
    moments are then cut like their DTensor parameter (the weights: `placed_like` before load_state_dict)."""
    experts = split_experts(model)
    if not experts:
        return
    params, index = dict(model.named_parameters()), _optimizer_index(optimizer)
    for name, kind in experts.items():
        if weights is not None and weights[name].shape[0] != params[name].shape[0]:
            weights[name] = this_ranks_rows(weights[name], kind)
        state = optim_state["state"].get(index[id(params[name])], {}) if optim_state is not None else {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = placed_like({key: this_ranks_rows(value, kind)}, {key: params[name]})[key]
