"""Replicated-parameter audit: do the ranks still hold the same values where they must?

Read from the parameter kinds (no layer class is inspected):

    group            what must be identical                        entries
    tensor-parallel  Replicated and PartialGrad parameters          norms, row-parallel biases, learned positions
                     (every rank of the group)                      (replicated, or PartialGrad under SP)
    tensor-parallel  the rows of a KvReplica,                       fused-QKV k/v replicas when p > num_kv_heads
                     on the ranks that share its `slot`
    data-parallel    every parameter (the replicas are copies)      everything; experts split over ep ranks
                     (ExpertShard: the ranks of the same ep rank)   (MoE) only between holders of the same ones

Each rank reduces every entry to two float64 checksums (the sum of its values and the sum of its values
weighted by a position pattern, so a swap of two elements is seen too) and one all-gather per group
exchanges [global rank, (slot, sum, weighted sum) per entry]. Every rank of a group then computes the
same verdict: the names of the entries whose checksums differ and the global ranks on each side.
Checksums are compared bit for bit (NaN equals NaN): the ranks run the same kernels on the same shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .collectives import all_gather_along_dim
from .param_kinds import ExpertShard, KvReplica, Sharded, local_rows, local_shard, parameter_kinds
from .parallel_state import ProcessGroup, get_global_rank, group_rank, group_size

__all__ = ["AuditEntry", "replica_entries", "replica_mismatches"]

_CHUNK = 1 << 22  # elements per float64 temporary: bounds the audit's memory for large embeddings
_PATTERN = 8191  # period of the position weights (prime, so no stride of a weight matrix lines up with it)


@dataclass(frozen=True)
class AuditEntry:
    name: str
    tensor: torch.Tensor
    slot: int = 0  # entries compare only with the ranks of the same slot


def replica_entries(model: nn.Module) -> tuple[list[AuditEntry], list[AuditEntry]]:
    """(entries compared across the tensor-parallel group, entries compared across the data-parallel group)."""
    tensor_parallel = []
    for name, (param, kind) in parameter_kinds(model).items():  # FSDP2: the ranks of a tp group share a dp shard
        if isinstance(kind, KvReplica):
            tensor_parallel.append(AuditEntry(f"{name}[k/v replica rows]", local_rows(param, kind.rows), kind.slot))
        elif not isinstance(kind, Sharded):
            tensor_parallel.append(AuditEntry(name, local_shard(param).tensor))
    # FSDP2's DTensors are split across the data-parallel ranks, not copied: one copy has no replica to differ from
    data_parallel = [AuditEntry(name, param, _expert_slot(kind))
                     for name, (param, kind) in parameter_kinds(model).items()
                     if getattr(param, "placements", None) is None]
    return tensor_parallel, data_parallel


def _expert_slot(kind) -> int:
    """Experts split over ep ranks (ExpertShard): only the dp ranks at the same ep rank hold the same ones."""
    return group_rank(kind.ep_group) if isinstance(kind, ExpertShard) else 0


@torch.no_grad()
def _checksums(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = tensor.detach().reshape(-1)
    plain = torch.zeros((), dtype=torch.float64, device=flat.device)
    weighted = torch.zeros_like(plain)
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start:start + _CHUNK].to(torch.float64)
        weights = torch.arange(start, start + chunk.numel(), device=flat.device, dtype=torch.int64) % _PATTERN + 1
        plain += chunk.sum()
        weighted += (chunk * weights.to(torch.float64)).sum()
    return plain, weighted


def _sides(rows: list[tuple[int, int, str]]) -> list[list[int]]:
    """Global ranks grouped by checksum, largest group first, for the ranks of one slot."""
    by_value: dict[str, list[int]] = {}
    for rank, _, value in rows:
        by_value.setdefault(value, []).append(rank)
    return sorted(by_value.values(), key=lambda ranks: (-len(ranks), ranks))


def _describe(name: str, where: str, sides: list[list[int]]) -> str:
    def ranks(r: list[int]) -> str:
        return f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}"

    if len(sides[0]) > len(sides[1]):  # a majority: name the ranks that left it
        odd = sides[1:]
        verb = "differs" if len(odd) == 1 and len(odd[0]) == 1 else "differ"
        return (f"{name} differs across the {where} group: {ranks(sides[0])} agree, "
                + "; ".join(ranks(side) for side in odd) + f" {verb}")
    return f"{name} differs across the {where} group: " + " vs ".join(ranks(side) for side in sides)


@torch.no_grad()
def _mismatches(entries: list[AuditEntry], group: ProcessGroup | None, where: str) -> list[str]:
    n = group_size(group)
    if n == 1 or not entries:
        return []
    device = entries[0].tensor.device
    mine = [torch.tensor([float(get_global_rank())], dtype=torch.float64, device=device)]
    for entry in entries:
        plain, weighted = _checksums(entry.tensor)
        mine.append(torch.stack([torch.tensor(float(entry.slot), dtype=torch.float64, device=device),
                                 plain, weighted]))
    table = all_gather_along_dim(torch.cat(mine), 0, group).view(n, -1).cpu().tolist()
    bad = []
    for i, entry in enumerate(entries):
        column = [(int(row[0]), int(row[1 + 3 * i]), f"{row[2 + 3 * i].hex()}/{row[3 + 3 * i].hex()}")
                  for row in table]
        slots = sorted({slot for _, slot, _ in column})
        for slot in slots:
            sides = _sides([r for r in column if r[1] == slot])
            if len(sides) > 1:
                label = entry.name if len(slots) == 1 else f"{entry.name} ({_slot_word(entry)} {slot})"
                bad.append(_describe(label, where, sides))
    return bad


def _slot_word(entry: AuditEntry) -> str:
    return "k/v slot" if entry.name.endswith("[k/v replica rows]") else "experts of ep rank"


def replica_mismatches(model: nn.Module, tp_group: ProcessGroup | None, dp_group: ProcessGroup | None) -> list[str]:
    """Descriptions of the parameters that differ where they must be identical (empty: all agree).

    Call on every rank (one all-gather per group of more than one rank). The descriptions name the
    parameter and the global ranks on each side; every rank of a group returns the same ones.
    """
    tensor_parallel, data_parallel = replica_entries(model)
    return (_mismatches(tensor_parallel, tp_group, "tensor-parallel")
            + _mismatches(data_parallel, dp_group, "data-parallel"))
