"""Experts split over an expert-parallel group (MoE at ep > 1, `param_kinds.ExpertShard`): which parameters, their
whole tensors (every expert, in global order along dim 0) and this rank's rows of a whole tensor.

Readers: GPTModel's canonical state dict (whole experts under their global index), the data-parallel wrapper (which
leaves split experts out) and the checkpoints, which hold every expert whole whatever ep a run uses (MoELayer's
load_state_dict keeps this rank's rows of whole experts).
"""

from __future__ import annotations

import torch
from torch import nn

from .collectives import all_gather_along_dim, full_tensor
from .param_kinds import ExpertShard, ParamKind, parameter_kinds
from .parallel_state import group_rank, group_size


def is_split(kind: ParamKind) -> bool:
    """Whether `kind` is experts split over more than one rank."""
    return isinstance(kind, ExpertShard) and group_size(kind.ep_group) > 1


def split_experts(model: nn.Module) -> dict[str, ExpertShard]:
    """The model's parameters split over more than one expert-parallel rank, by name."""
    return {name: kind for name, (_, kind) in parameter_kinds(model).items() if is_split(kind)}


def whole(tensor: torch.Tensor, kind: ParamKind) -> torch.Tensor:
    """Every expert of a split parameter (an all-gather over its ep group, after FSDP2's over the ranks holding
    the same experts where it is a DTensor); any other tensor as it is."""
    return all_gather_along_dim(full_tensor(tensor.detach()), 0, kind.ep_group) if is_split(kind) else \
        tensor.detach()


def this_ranks_rows(tensor: torch.Tensor, kind: ExpertShard) -> torch.Tensor:
    """This rank's experts of a whole tensor (no communication)."""
    return tensor.chunk(group_size(kind.ep_group))[group_rank(kind.ep_group)].contiguous()
