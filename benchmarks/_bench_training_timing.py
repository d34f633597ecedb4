"""Timing for benchmarks/benchmark_training.py: statistics of the alternating rounds (_bench_measure.time_variants,
the attention benchmark's loop), and the variants of our step whose tensor- or data-parallel communication is
switched off (to measure what it costs).

Exposed communication of a group = the median over rounds of (the real step - the same step with that group's
collectives made no-ops), the two timed next to each other in each alternating round. It is the time the step
would save if the group's communication were free: what overlap has not hidden, including the compute thread's
waits and the launch cost of each collective. Pairing by round cancels the host's drift between rounds, which
the difference of the two medians (variants_ms) does not: on the 2-core host that drift is 100-200 ms IQR.
The no-op variants compute wrong numbers (the collectives return their input, or zeros where they would
gather), so the parameters are restored after each of them.
"""

from __future__ import annotations

import contextlib
import statistics

import torch
import torch.distributed as dist

# the torch.distributed entry points that parallel_attention's collectives call (either spelling)
_TENSOR_COLLECTIVES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                       "reduce_scatter_tensor")


class _DoneWork:
    """What an async no-op collective returns: already finished."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _no_op(real, group):
    def call(*args, **kwargs):
        if kwargs.get("group") is not group:
            return real(*args, **kwargs)
        if real.__name__ != "all_reduce":  # (out, in): a gather or reduce-scatter; all-reduce leaves x as is
            args[0].zero_()
        return _DoneWork() if kwargs.get("async_op") else None

    return call


@contextlib.contextmanager
def collectives_off(group):
    """Inside: every tensor collective on `group` issued through torch.distributed returns at once."""
    saved = {name: getattr(dist, name) for name in _TENSOR_COLLECTIVES if hasattr(dist, name)}
    try:
        for name, real in saved.items():
            setattr(dist, name, _no_op(real, group))
        yield
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)


@contextlib.contextmanager
def data_parallel_off(run):
    """Inside: the training forward runs on the raw model, not DDP's wrapper: no gradient all-reduce."""
    saved = getattr(run, "data_parallel_model", None)
    run.data_parallel_model = run.model
    try:
        yield
    finally:
        run.data_parallel_model = saved


@contextlib.contextmanager
def parameters_restored(model: torch.nn.Module):
    """Put the parameters back as they were (a no-op variant's update is wrong)."""
    saved = [p.detach().clone() for p in model.parameters()]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(model.parameters(), saved):
                p.copy_(s)


def paired_difference_ms(times_ms: list[float], baseline_ms: list[float]) -> float:
    """Median over rounds of times_ms[i] - baseline_ms[i] (the two variants timed in the same round i)."""
    return statistics.median(a - b for a, b in zip(times_ms, baseline_ms, strict=True))


def summary_ms(times_ms: list[float]) -> dict:
    """Median and interquartile range of step times, in milliseconds."""
    ms = sorted(times_ms)
    q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else (ms[0],) * 3
    return {"median": statistics.median(ms), "q1": q1, "q3": q3, "iqr": q3 - q1, "n": len(ms)}
