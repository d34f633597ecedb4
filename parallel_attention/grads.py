"""finalize_grads: complete the gradients that hold only this rank's share of a sum.

Two kinds of parameters are left with partial gradients by tensor parallelism:
- parameters replicated across the tensor-parallel group but fed only this rank's tokens under
  sequence parallelism (the output bias of RowParallelLinear, norms of a model);
- k/v heads replicated on several ranks when p > num_kv_heads: each replica sees only the
  queries of its own rank.
Modules describe theirs with `partial_grads()`. All of them go into one flat buffer, slot by
slot, and one all-reduce per group sums them: ranks that share a slot add, others add zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .parallel_state import ProcessGroup, group_size


@dataclass(frozen=True)
class PartialGrad:
    """Rows `rows` of `param`'s gradient, summed across the ranks of `group` that use slot `slot`.

    Every rank of the group lists the same entries in the same order, with the same
    `num_slots` and row counts; only `slot` (which replica set the rank belongs to) differs.
    """

    param: nn.Parameter
    group: ProcessGroup
    rows: slice = field(default_factory=lambda: slice(None))
    slot: int = 0
    num_slots: int = 1


def _grad_rows(entry: PartialGrad) -> torch.Tensor:
    if entry.param.grad is None:
        entry.param.grad = torch.zeros_like(entry.param)
    return entry.param.grad[entry.rows]


@torch.no_grad()
def finalize_grads(module: nn.Module) -> None:
    """Call after backward, before the optimiser step. Issues one all-reduce per group that
    needs it, none when nothing does (p = 1, no sequence parallelism, no k/v replication)."""
    by_group: dict[int, list[PartialGrad]] = {}
    for m in module.modules():
        collect = getattr(m, "partial_grads", None)
        if collect is None:
            continue
        for entry in collect():
            if group_size(entry.group) > 1:
                by_group.setdefault(id(entry.group), []).append(entry)
    for entries in by_group.values():
        views = [_grad_rows(e) for e in entries]
        sizes = [v.numel() * e.num_slots for v, e in zip(views, entries)]
        buffer = torch.zeros(sum(sizes), dtype=views[0].dtype, device=views[0].device)
        offset = 0
        for view, entry, size in zip(views, entries, sizes):
            start = offset + entry.slot * view.numel()
            buffer[start:start + view.numel()].copy_(view.reshape(-1))
            offset += size
        dist.all_reduce(buffer, group=entries[0].group)
        offset = 0
        for view, entry, size in zip(views, entries, sizes):
            start = offset + entry.slot * view.numel()
            view.copy_(buffer[start:start + view.numel()].view_as(view))
            offset += size
