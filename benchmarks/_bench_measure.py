"""How benchmarks/benchmark_attention.py measures a step: wall time (alternating variants), collectives
and their payload, and peak memory. A `step` is its Step: clear(), forward(), backward(y), call."""

from __future__ import annotations

import contextlib
import gc
import os
import time

import torch
import torch.distributed as dist

from _bench_reference import CollectiveCounter


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- memory
def memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated during the step - allocated before it"
    return "peak of live CPU tensor bytes allocated during the step (torch.profiler, profile_memory)"


def peak_memory_mb(step, device: torch.device) -> float:
    """Peak memory of one step (gradients cleared first) above what was held before it, in MiB.

    On CPU there is no allocator counter to read: the profiler records every allocation and free
    of the CPU allocator, and the running sum's maximum is the peak. (Peak RSS is no substitute:
    glibc caching and transparent huge pages move it by several tensors from step to step.)
    """
    step.clear()
    gc.collect()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    saved_stderr, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # the profiler's C++ side logs start/stop lines to fd 2: mute them
    os.close(devnull)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()  # negative for a free
        peak = max(peak, live)
    return peak / 2**20


# ----------------------------------------------------------------------------- time and collectives
def count_collectives(step, p: int) -> dict:
    """Collectives of one step, forward and backward apart, with their payload."""
    counter = CollectiveCounter(p)
    step.clear()
    with counter.counting():
        y = step.forward()
        fwd = list(counter.calls)
    with counter.counting():
        step.backward(y)
        bwd = list(counter.calls)
    mb = sum(b for _, b in fwd + bwd) / 2**20
    return {"fwd": len(fwd), "bwd": len(bwd), "mb_per_step": mb, "calls": [list(c) for c in fwd + bwd]}


def time_variants(steps: dict, warmup: int, iters: int, device: torch.device,
                  contexts: dict | None = None) -> dict[str, list[float]]:
    """Per variant, ms per step of the slowest rank, one value per timed repetition (both benchmarks' loop).

    Variants alternate within each repetition, rotating who goes first, so that drift in the machine (clock,
    caches, the other rank) hits all of them alike. A step with clear() (benchmark_attention's Step) is
    cleared first; `contexts` (name -> context factory) wraps a variant's step, untimed entry and exit.
    """
    names, contexts = list(steps), contexts or {}
    times = {n: [] for n in names}
    gc.collect()
    for i in range(warmup + iters):
        for name in names[i % len(names):] + names[:i % len(names)]:
            with contexts.get(name, contextlib.nullcontext)():
                getattr(steps[name], "clear", lambda: None)()
                dist.barrier()
                sync(device)
                start = time.perf_counter()
                steps[name]()
                sync(device)
                elapsed = (time.perf_counter() - start) * 1e3
            if i >= warmup:
                times[name].append(elapsed)
    for name in names:  # a step takes as long as its slowest rank
        t = torch.tensor(times[name], dtype=torch.float64, device=device)  # NCCL reduces device tensors
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[name] = t.tolist()
    return times
