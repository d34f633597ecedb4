"""(a) Every group's collectives give the right results, and the all-reduce bus bandwidth of each.

On the tensor-parallel, data-parallel and world groups: all-reduce of (rank + 1) sums to n(n+1)/2,
all-gather returns every rank's block in rank order, reduce-scatter returns this rank's block of
the sum. Bus bandwidth is nccl-tests' measure: 2 (n-1)/n * bytes / time of one all-reduce.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..tensor_parallel.collectives import all_gather_along_dim, all_reduce
from ..tensor_parallel.mappings import reduce_scatter_to_sequence_parallel_region
from ..tensor_parallel.parallel_state import group_rank, group_size
from .context import CheckContext


def _errors(group, device) -> list[str]:
    n, r = group_size(group), group_rank(group)
    errors = []
    summed = all_reduce(torch.full((5,), float(r + 1), device=device), group)
    if not torch.equal(summed.cpu(), torch.full((5,), n * (n + 1) / 2)):
        errors.append(f"all-reduce gave {summed.cpu().tolist()[:2]}..., expected {n * (n + 1) / 2}")
    gathered = all_gather_along_dim(torch.full((2, 3), float(r), device=device), 0, group)
    if not torch.equal(gathered.cpu(), torch.arange(n, dtype=torch.float32).repeat_interleave(2)[:, None].expand(-1, 3)):
        errors.append("all-gather returned blocks out of rank order or wrong")
    base = torch.arange(2 * n * 3, dtype=torch.float32).view(2 * n, 3)
    scattered = reduce_scatter_to_sequence_parallel_region((base * (r + 1)).to(device), group)
    if not torch.equal(scattered.cpu(), (base * (n * (n + 1) / 2))[2 * r:2 * r + 2]):
        errors.append("reduce-scatter returned the wrong block of the sum")
    return errors


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bus_bandwidth(group, device: torch.device, nbytes: int, iters: int = 5) -> float | None:
    """All-reduce bus bandwidth in bytes/s (None for a group of one)."""
    n = group_size(group)
    if n == 1:
        return None
    buffer = torch.zeros(nbytes // 4, device=device)
    all_reduce(buffer, group)  # warm-up: connections and buffers are set up on first use
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        all_reduce(buffer, group)
    _synchronize(device)
    return 2 * (n - 1) / n * nbytes / ((time.perf_counter() - start) / iters)


def check_collectives(ctx: CheckContext, bandwidth_bytes: int) -> tuple[bool, str]:
    groups = {"tensor-parallel": ctx.tp_group, "data-parallel": ctx.dp_group, "world": dist.group.WORLD}
    parts, failed = [], []
    for label, group in groups.items():
        errors = _errors(group, ctx.device)
        failed += [f"{label}: {e}" for e in errors]
        bandwidth = bus_bandwidth(group, ctx.device, bandwidth_bytes)
        speed = "" if bandwidth is None else f", all-reduce {bandwidth / 1e9:.2f} GB/s bus"
        parts.append(f"{label}({group_size(group)}){speed}")
    summary = f"all-reduce/all-gather/reduce-scatter on {'; '.join(parts)} ({bandwidth_bytes / 2**20:g} MiB)"
    return not failed, summary if not failed else "; ".join(failed)
