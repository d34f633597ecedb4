"""(c) Initialisation is p-invariant, and what should be identical across ranks is.

init: after the same seed, the canonical weights of the models at this p are bitwise those of the
same models built at p = 1 (a group of this rank alone) on this device and dtype.
replicas: reading the parameter kinds, Replicated and PartialGrad parameters are identical on every
rank of the tensor-parallel group, the rows of a KvReplica parameter on
the ranks that share its slot, and every parameter on every rank of the data-parallel group; the
comparison is `tensor_parallel.audit`, the one the trainer runs every `training.audit_interval` steps.
"""

from __future__ import annotations

import torch
from torch import nn

from ..tensor_parallel import Sharded, manual_seed, parameter_kinds
from ..tensor_parallel.audit import replica_entries, replica_mismatches
from ..transformer import AttentionConfig, GPTModel, ParallelSelfAttention
from .context import CheckContext, attention_cases, model_configs


def _modules(ctx: CheckContext, tp_group) -> dict[str, nn.Module]:
    """The checked models and attention blocks, each built right after seeding (so each is p-invariant)."""
    built = {}
    for family, cfg in model_configs(ctx.tp_size).items():
        for sp in (False, True):
            manual_seed(ctx.seed)
            built[f"{family}{'+sp' if sp else ''}"] = GPTModel(cfg, sequence_parallel=sp, tp_group=tp_group,
                                                               device=ctx.device, dtype=ctx.dtype)
    for name, (kwargs, _) in attention_cases(ctx.tp_size).items():
        manual_seed(ctx.seed)
        built[f"{name} attention"] = ParallelSelfAttention(AttentionConfig(**kwargs, params_dtype=ctx.dtype),
                                                           tp_group=tp_group, device=ctx.device)
    return built


def check_init(ctx: CheckContext) -> tuple[bool, str]:
    here, single = _modules(ctx, ctx.tp_group), _modules(ctx, ctx.solo_group)
    differing, compared = [], 0
    for label, module in here.items():
        mine, reference = module.canonical_state_dict(), single[label].canonical_state_dict()
        compared += len(reference)
        differing += [f"{label} {k}" for k, v in reference.items() if not torch.equal(mine[k], v)]
    detail = f"{compared} canonical tensors of {len(here)} modules at p={ctx.tp_size} vs p=1 after the same seed"
    return not differing, detail + (f"; differ: {', '.join(differing[:4])}" if differing else ", bitwise equal")


def audit(module: nn.Module, tp_group, dp_group) -> tuple[int, list[str]]:
    """(number of tensors audited, descriptions of those that differ across ranks): the training audit's."""
    tensor_parallel, data_parallel = replica_entries(module)
    return len(tensor_parallel) + len(data_parallel), replica_mismatches(module, tp_group, dp_group)


@torch.no_grad()
def perturb_one_replica(module: nn.Module) -> str:
    """For --inject-fault replica: shift the first non-sharded parameter (exactly representable shift)."""
    name, (param, _) = next((n, pk) for n, pk in parameter_kinds(module).items() if not isinstance(pk[1], Sharded))
    param.add_(0.0625)
    return name


def check_replicas(ctx: CheckContext) -> tuple[bool, str]:
    modules = _modules(ctx, ctx.tp_group)
    if ctx.fault == "replica" and ctx.world_size > 1 and ctx.global_rank == ctx.world_size - 1:
        perturb_one_replica(next(iter(modules.values())))
    audited, bad = 0, []
    for label, module in modules.items():
        count, differing = audit(module, ctx.tp_group, ctx.dp_group)
        audited += count
        bad += [f"{label} {d}" for d in differing]
    detail = (f"{audited} tensors of {len(modules)} modules audited (tp {ctx.tp_size}, "
              f"dp {ctx.world_size // ctx.tp_size})")
    return not bad, detail + (f"; {len(bad)} differ: {', '.join(bad[:3])}" if bad else ", identical")
