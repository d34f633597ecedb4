"""The global gradient norm and `clip_grad_norm_`, read off the declared parameter kinds (one implementation: the
trainer's `training.gradients` and users' loops both call it).

Each parameter counts once, as if the model were on one rank:

    kind                          this rank's share of sum |g|^q (q = norm_type)
    Sharded                       its whole local gradient (the shards add up over the group)
    Replicated                    all of it on tensor-parallel rank 0, nothing elsewhere
    KvReplica                     all of it, minus (1 - 1/replicas) of the shared rows (k/v replicas)
    PartialGrad                   as Replicated (call after the shares are summed)
    a DTensor gradient (FSDP2)    its local shard; the sum also runs over each mesh dimension it is Shard on
    ExpertShard                   as Replicated over tp; the sum also runs over the expert-parallel group

inf-norm: the maximum of |g| over every local gradient and every rank (replicas change nothing). Call after
every reduction of the step (data-parallel average, `finalize_grads` where the model needs it).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_reduce
from .param_kinds import ExpertShard, KvReplica, Sharded, is_distributed, local_rows, local_shard, parameter_kinds
from .parallel_state import ProcessGroup, group_rank, group_size


def _shard_groups(grad: torch.Tensor) -> tuple:
    """The groups a DTensor gradient's shards are spread over (the mesh dimensions it is Shard on); () else."""
    placements = getattr(grad, "placements", None)
    if placements is None:
        return ()
    return tuple(grad.device_mesh.get_group(i) for i, placement in enumerate(placements) if placement.is_shard())


def _expert_groups(kind) -> tuple:
    """(the expert-parallel group,) for experts split over more than one rank: each holds other experts."""
    return (kind.ep_group,) if isinstance(kind, ExpertShard) and group_size(kind.ep_group) > 1 else ()


def _power_sum(x: torch.Tensor, q: float) -> torch.Tensor:
    """sum |x|^q in float32 (vector_norm reads x once; pow(2).sum() would write a squared copy first)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if math.isinf(q):
        return torch.linalg.vector_norm(x, ord=q, dtype=torch.float32)
    return torch.linalg.vector_norm(x, ord=q, dtype=torch.float32).pow(q)


def _share(grad: torch.Tensor, kind, q: float, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's share of sum |g|^q such that the sum over the tensor-parallel group counts each entry once
    (a DTensor gradient: of its local shard)."""
    total = _power_sum(local_shard(grad).tensor, q)
    if isinstance(kind, Sharded) or math.isinf(q):
        return total
    if isinstance(kind, KvReplica):  # shared rows inside a sharded tensor
        replicas = tp_size // kind.num_slots
        return total - (1.0 - 1.0 / replicas) * _power_sum(local_rows(grad, kind.rows), q)
    return total if tp_rank == 0 else torch.zeros_like(total)  # identical on every rank


def tensor_parallel_group_of(model: nn.Module) -> ProcessGroup | None:
    """The one tensor-parallel group the model's declared kinds name (None when no kind spans ranks)."""
    groups = {id(kind.group): kind.group for _, kind in parameter_kinds(model).values() if is_distributed(kind)}
    if len(groups) > 1:
        raise ValueError(f"the model's parameters declare {len(groups)} different tensor-parallel groups: pass "
                         "tp_group= to say which one the norm reduces over.")
    return next(iter(groups.values()), None)


def _combine(a: torch.Tensor | None, b: torch.Tensor, q: float) -> torch.Tensor:
    return b if a is None else (torch.maximum(a, b) if math.isinf(q) else a + b)


@torch.no_grad()
def global_grad_norm(model: nn.Module, tp_group: ProcessGroup | None, norm_type: float = 2.0,
                     pp_group: ProcessGroup | None = None, counted_elsewhere=()) -> torch.Tensor:
    """The norm of all gradients as if the model were on one rank (see the module docstring), on every rank.

    Pipeline stages: `model` is this stage's part; the partial sums add up over `pp_group` too, and the
    parameters in `counted_elsewhere` (a copy whose original another stage holds: tied embeddings) are left out."""
    q = float(norm_type)
    tp_rank, tp_size = group_rank(tp_group), group_size(tp_group)
    skip = {id(p) for p in counted_elsewhere}
    shard_groups: dict[tuple, tuple] = {}  # per set of FSDP2 shard groups (by their ids): the groups
    partial_sums: dict[tuple, torch.Tensor] = {}  # and the partial sum of the gradients sharded over them
    for param, kind in parameter_kinds(model).values():
        if param.grad is None or id(param) in skip:
            continue
        groups = _shard_groups(param.grad) + _expert_groups(kind)
        key = tuple(id(g) for g in groups)
        shard_groups[key] = groups
        partial_sums[key] = _combine(partial_sums.get(key), _share(param.grad, kind, q, tp_rank, tp_size), q)
    op = dist.ReduceOp.MAX if math.isinf(q) else dist.ReduceOp.SUM
    total = None
    for key, partial in partial_sums.items():
        for group in shard_groups[key]:
            all_reduce(partial, group, op)
        total = _combine(total, partial, q)
    if total is None:  # no gradient on this rank: a zero on the model's device (NCCL reduces no CPU tensor)
        total = torch.zeros((), dtype=torch.float32, device=next((p.device for p in model.parameters()), None))
    total = all_reduce(all_reduce(total, tp_group, op), pp_group, op)
    return total if math.isinf(q) else total.sqrt() if q == 2.0 else total.pow(1.0 / q)


@torch.no_grad()
def scale_grads_(model: nn.Module, max_norm: float, total_norm: torch.Tensor) -> None:
    """Multiply every gradient by min(1, max_norm / (total_norm + 1e-6)), in place (DTensors: their local shard)."""
    grads = [local_shard(p.grad).tensor for p in model.parameters() if p.grad is not None]
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(device=g.device, dtype=g.dtype))


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    tp_group: ProcessGroup | None = None) -> torch.Tensor:
    """Clip the model's gradients in place to a global norm of `max_norm` and return that norm before clipping,
    like torch.nn.utils.clip_grad_norm_, but counting each parameter once across the tensor-parallel group
    (read off the parameter kinds; `tp_group` defaults to the one they name) and across FSDP2's shards.

    A collective: every rank of the model's groups calls it. Works for `parallelize`d transformers models and
    for GPTModel (after finalize_grads)."""
    group = tp_group if tp_group is not None else tensor_parallel_group_of(model)
    total = global_grad_norm(model, group, norm_type)
    scale_grads_(model, float(max_norm), total)
    return total
