"""Parameter kinds: each parallel module declares once what its parameters are; everyone reads that
(docs/architecture.md, "Parameter kinds").

    kind          on the ranks of the tensor-parallel group         gradient after backward
    Sharded       this rank holds 1/p of it along `dim`             complete for this rank's part
    Replicated    identical on every rank                           complete on every rank
    PartialGrad   identical on every rank                           each rank holds only its share of the sum
    KvReplica     rows `rows` identical on the ranks that share     the ranks of a slot each hold their share of
                  `slot`; outside them sharded along `sharded_dim`  rows `rows`; the rest complete
    ExpertShard   identical on every rank (as Replicated, or        as Replicated or PartialGrad over `group`;
                  PartialGrad when `partial`); dim 0 (the experts)  over the data-parallel ranks, only the ranks
                  split over the expert-parallel group              of the same experts hold a copy (see below)

PartialGrad and KvReplica are what tensor parallelism leaves half-finished: under sequence parallelism a
norm or the row-parallel output bias sees only this rank's tokens (PartialGrad); when p > num_kv_heads each
k/v replica in the fused QKV weight sees only this rank's queries (KvReplica). `finalize_grads` sums both.
Neither is DTensor's `Partial` (pending sums of *values*): here the values are complete, only gradients are
partial. A module declares kinds with `parameter_kinds() -> {local name: kind}` (names relative to the module,
so a module may declare its children's parameters: the outermost declaration wins). Parameters no module
declares are Replicated (plain torch modules inside a tensor-parallel model: same seed, same values).

ExpertShard (mixture of experts at ep > 1): the ep ranks are ranks of the data x context-parallel group, so the
data-parallel average (DDP) must leave these parameters out (`expert_shards.split_experts`); `finalize_grads` sums their
gradients over the ranks holding the same experts (`expert_data_group`, derived from the ep group within dp x cp)
and divides by dp x cp, which is the average the other parameters get (under FSDP2, whose reduce-scatter over
`expert_data_group` is that sum, only the division).

Readers: `finalize_grads` here, the global gradient norm (`grad_clip`), canonical (checkpoint) gathering
(GPTModel.canonical_state_dict) and the replicated-parameter audit (`audit`). No reader inspects layer classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .collectives import all_reduce
from .parallel_state import ProcessGroup, group_size

__all__ = ["ExpertShard", "KvReplica", "LocalShard", "ParamKind", "PartialGrad", "REMOVED_NAMES", "Replicated",
           "SharedRows", "Sharded", "finalize_grads", "is_distributed", "local_rows",
           "local_shard", "parameter_kinds", "reduce_expert_grads", "removed_name_error", "shared_rows"]


@dataclass(frozen=True)
class Sharded:
    """This rank holds the p-th part of the full parameter along `dim`."""

    dim: int
    group: ProcessGroup | None = None


@dataclass(frozen=True)
class Replicated:
    """The same full parameter on every rank of `group`, with the full gradient on each."""

    group: ProcessGroup | None = None


@dataclass(frozen=True)
class PartialGrad:
    """The same full parameter on every rank of `group`, but each rank's gradient is only its share of the sum
    (its own tokens under sequence parallelism, its own heads for per-head norms).

    reduced_in_backward: the module sums the shares inside its own backward (transformers models made parallel
    by `hf.parallelize`, whose training loops never call finalize_grads): finalize_grads leaves it alone."""

    group: ProcessGroup | None = None
    reduced_in_backward: bool = False


@dataclass(frozen=True)
class KvReplica:
    """Rows `rows` of a parameter sharded along `sharded_dim` hold a k/v head that p > num_kv_heads replicates:
    identical on the ranks that use slot `slot` (of `num_slots`, the k/v heads), each rank's gradient of them
    only its share of the sum. Every rank of the group declares the same rows and `num_slots`; `slot` differs.

    reduced_in_backward: as for PartialGrad; the norm still counts the shared rows once."""

    group: ProcessGroup | None
    rows: slice
    slot: int
    num_slots: int
    sharded_dim: int = 0
    reduced_in_backward: bool = False


@dataclass(frozen=True)
class ExpertShard:
    """An MoE layer's stacked experts split along dim 0 over `ep_group` (ranks of dp x cp); over the tensor-parallel
    `group` identical, each rank's gradient its tokens' share when `partial` (sequence parallelism)."""

    group: ProcessGroup | None
    ep_group: ProcessGroup | None
    expert_data_group: ProcessGroup | None  # the dp x cp ranks that hold the same experts
    data_context_size: int  # dp x cp: what the gradient average divides by
    partial: bool = False
    reduced_in_backward: bool = False


ParamKind = Sharded | Replicated | PartialGrad | KvReplica | ExpertShard


# names removed in 0.4, each refused (AttributeError) with what replaces it, as AttentionConfig's REMOVED_ARGUMENTS
REMOVED_NAMES = {
    "Partial": "declare PartialGrad (a replicated parameter whose gradient is partial) or KvReplica (k/v replica "
               "rows when p > num_kv_heads)",
}


def removed_name_error(module: str, name: str) -> AttributeError:
    """The error for `module`.`name`: what replaces it where the name was removed, else Python's own message."""
    if name in REMOVED_NAMES:
        return AttributeError(f"{module}.{name} was removed in 0.4: {REMOVED_NAMES[name]}.")
    return AttributeError(f"module {module!r} has no attribute {name!r}")


def __getattr__(name: str):
    raise removed_name_error(__name__, name)


class SharedRows(NamedTuple):
    """The rows of a parameter whose gradient finalize_grads sums: slot `slot` of `num_slots`."""

    rows: slice
    slot: int
    num_slots: int


def shared_rows(kind: ParamKind) -> SharedRows | None:
    """The rows of a kind whose gradient finalize_grads must sum, None for the others: a PartialGrad is all rows
    of one slot."""
    if isinstance(kind, PartialGrad) or (isinstance(kind, ExpertShard) and kind.partial):
        return SharedRows(slice(None), 0, 1)
    if isinstance(kind, KvReplica):
        return SharedRows(kind.rows, kind.slot, kind.num_slots)
    return None


def parameter_kinds(model: nn.Module) -> dict[str, tuple[nn.Parameter, ParamKind]]:
    """Every parameter of `model` by qualified name, with its declared kind (see the module docstring)."""
    kinds: dict[str, ParamKind] = {}
    # named_modules lists a parent before its children: walk it backwards so that parents override
    for prefix, module in reversed(list(model.named_modules())):
        declare = getattr(module, "parameter_kinds", None)
        if declare is None:
            continue
        for name, kind in declare().items():
            kinds[f"{prefix}.{name}" if prefix else name] = kind
    return {name: (param, kinds.get(name, Replicated())) for name, param in model.named_parameters()}


def is_distributed(kind: ParamKind) -> bool:
    """Whether the kind involves more than one rank (at p = 1 every kind is a plain parameter)."""
    return group_size(kind.group) > 1


class LocalShard(NamedTuple):
    """This rank's part of a tensor, and the index in the whole tensor of its first row."""

    tensor: torch.Tensor
    offset: int


def local_shard(tensor: torch.Tensor) -> LocalShard:
    """This rank's part of `tensor`: a DTensor (FSDP2 shards each rank's tensor along dim 0 over the
    data-parallel mesh dimension) gives its local shard; a plain tensor is all of itself, at row 0."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return LocalShard(tensor, 0)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
    return LocalShard(tensor.to_local(), offset[0] if offset else 0)


def local_rows(tensor: torch.Tensor, rows: slice) -> torch.Tensor:
    """The rows `rows` (dim 0 of the whole `tensor`) that this rank's part of it holds (see local_shard)."""
    local, offset = local_shard(tensor)
    if local.dim() == 0:
        return local
    start, stop, _ = rows.indices(tensor.shape[0])
    start, stop = min(max(start - offset, 0), local.shape[0]), min(max(stop - offset, 0), local.shape[0])
    return local[start:max(start, stop)]


def _grad_rows(param: nn.Parameter, rows: slice) -> torch.Tensor:
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return local_rows(param.grad, rows)


@torch.no_grad()
def finalize_grads(module: nn.Module) -> None:
    """Complete partial gradients; call after backward, before the optimiser step.

    All partial rows of one group go into one flat buffer, slot by slot, and one all-reduce sums
    them (ranks sharing a slot add their shares, the others add zeros). One all-reduce per group
    that needs it; none when nothing does (p = 1, no sequence parallelism, no k/v replication). First the
    experts split over ep > 1 ranks get their data-parallel average (`reduce_expert_grads`).
    Under FSDP2 (zero_stage 3) the gradients are DTensors sharded over the data-parallel group: the
    tensor-parallel sum and the data-parallel reduce-scatter commute, so each rank sums the partial rows
    its local shard holds (`local_rows`; the ranks of one tensor-parallel group hold the same rows).
    """
    reduce_expert_grads(module)
    groups: dict[int, ProcessGroup] = {}
    by_group: dict[int, list[tuple[nn.Parameter, SharedRows]]] = {}
    for param, kind in parameter_kinds(module).values():
        shared = shared_rows(kind)
        if shared is not None and is_distributed(kind) and not kind.reduced_in_backward:
            groups[id(kind.group)] = kind.group
            by_group.setdefault(id(kind.group), []).append((param, shared))
    for key, entries in by_group.items():
        views = [_grad_rows(param, shared.rows) for param, shared in entries]
        sizes = [view.numel() * shared.num_slots for view, (_, shared) in zip(views, entries)]
        if not sum(sizes):  # FSDP2 left this rank no row of them (the ranks of one tp group share a dp rank)
            continue
        buffer = torch.zeros(sum(sizes), dtype=views[0].dtype, device=views[0].device)
        offsets = [sum(sizes[:i]) + shared.slot * view.numel()  # this rank's slot within the parameter's part
                   for i, (view, (_, shared)) in enumerate(zip(views, entries))]
        for view, start in zip(views, offsets):
            buffer[start:start + view.numel()].copy_(view.reshape(-1))
        all_reduce(buffer, groups[key])
        for view, start in zip(views, offsets):
            view.copy_(buffer[start:start + view.numel()].view_as(view))


@torch.no_grad()
def reduce_expert_grads(module: nn.Module) -> int:
    """Average the gradients of ExpertShard parameters as DDP averages the others over dp x cp: summed over the
    ranks that hold the same experts (the dp x cp ranks at this rank's place in its ep group, `expert_data_group`),
    divided by dp x cp. One all-reduce per ep group that needs it; returns their number. Under FSDP2 (DTensor
    experts, zero_stage 3) its reduce-scatter over `expert_data_group` was the sum: only the division is left."""
    by_group: dict[int, tuple[ExpertShard, list[nn.Parameter]]] = {}
    for param, kind in parameter_kinds(module).values():
        if not isinstance(kind, ExpertShard) or group_size(kind.ep_group) == 1:
            continue
        if getattr(param, "placements", None) is None:
            by_group.setdefault(id(kind.expert_data_group), (kind, []))[1].append(param)
        elif param.grad is not None:
            local_shard(param.grad).tensor.div_(kind.data_context_size)
    for kind, params in by_group.values():
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), kind.expert_data_group)
        flat.div_(kind.data_context_size)
        for param, reduced in zip(params, flat.split([g.numel() for g in grads])):
            param.grad = reduced.view_as(param).clone()
    return len(by_group)
