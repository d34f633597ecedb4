"""Run a function on several gloo ranks in spawned processes, for tests.

`run_distributed(fn, world_size, tp_size, *args)` starts `world_size` processes from a forkserver that
has imported torch and this package once (`preloaded_context`; the forkserver never creates a process group, so
its forks start clean where a fork of a process holding gloo state could deadlock), joins them through a file
store (no port to race for), sets up the tensor-parallel groups, calls `fn(*args)` on every rank and
returns the per-rank results in rank order. A rank's exception is re-raised in the parent
with its traceback; a hang past `timeout` seconds kills every rank and fails.

`fn` must be a module-level function (spawned processes import it by name).

A spawned interpreter costs each rank about 3 s of CPU (importing torch); a fork of the forkserver costs
about none. And by default the ranks stay up between calls (one set per world size, see rank_pool): each
call resets the state a fresh process would have (default generator seed, default dtype, model-parallel
groups of the requested size, collective guard off). `fresh=True` spawns new ranks, for functions that
change what a reset cannot undo (the world group, environment variables, the collective guard, killing a
rank); a failing or hanging call closes its pool, so a broken group is never reused.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import tempfile
import time
import traceback

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240

# what every rank imports: the forkserver imports it once, and each rank is a fork of it
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "parallel_attention", "parallel_attention.training"]


def preloaded_context():
    """torch.multiprocessing's forkserver context, its server preloaded with PRELOAD."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def crash_log(init_file: str, rank: int) -> str:
    """Where rank `rank` writes Python's stacks if a signal kills it (see enable_crash_log)."""
    return f"{init_file}.crash{rank}"


def enable_crash_log(init_file: str, rank: int) -> None:
    """Every thread's Python stack into crash_log(...) if this rank dies of SIGSEGV, SIGABRT or the like: a rank's
    own stderr goes to whichever test's capture was open when the forkserver started, so _collect reads this file
    into the failure instead."""
    import faulthandler

    faulthandler.enable(file=open(crash_log(init_file, rank), "w"), all_threads=True)  # noqa: SIM115 (held by faulthandler)


def _worker(rank, world_size, tp_size, init_file, fn, args, results, timeout, backend):
    import torch
    import torch.distributed as dist

    import parallel_attention as pa

    enable_crash_log(init_file, rank)
    torch.set_num_threads(1)  # ranks share two cores: do not oversubscribe them
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        pa.initialize_model_parallel(tp_size)
        value = fn(*args)
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        pa.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, tp_size: int | None = None, *args, timeout: float = DEFAULT_TIMEOUT_S,
                    backend: str = "gloo", fresh: bool = False):
    """fn(*args) on each of `world_size` ranks (tensor-parallel size `tp_size`, default all).

    backend="nccl" runs rank r on cuda:r (one GPU per rank, as NCCL requires); it always spawns fresh ranks.
    """
    tp_size = world_size if tp_size is None else tp_size
    if not fresh and backend == "gloo":
        from rank_pool import reused_ranks

        return reused_ranks(world_size).run_reset(fn, tp_size, *args, timeout=timeout)
    ctx = preloaded_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, tp_size, init_file, fn, args, results, timeout, backend),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, timeout, init_file)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)


def _collect(procs, results, timeout, init_file=None):
    collected = {}
    deadline = time.monotonic() + timeout
    dead_since: dict[int, float] = {}
    while len(collected) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(len(procs))) - set(collected))
            raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s (hang in a collective?)")
        try:
            rank, ok, payload = results.get(timeout=min(1.0, remaining))
        except queue.Empty:
            now = time.monotonic()
            for rank, p in enumerate(procs):
                if rank not in collected and not p.is_alive():
                    # allow a moment for a report still in the pipe, then call it a crash
                    if now - dead_since.setdefault(rank, now) > 5:
                        raise RuntimeError(f"rank {rank} exited with code {p.exitcode} without reporting"
                                           + _crash_stacks(init_file, len(procs)))
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        collected[rank] = pickle.loads(payload)
    return [collected[r] for r in range(len(procs))]


def _crash_stacks(init_file, world_size: int) -> str:
    """What the ranks' crash logs hold (empty where none was written)."""
    if init_file is None:
        return ""
    texts = []
    for rank in range(world_size):
        try:
            with open(crash_log(init_file, rank), encoding="utf-8", errors="replace") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            texts.append(f"\n--- rank {rank}'s stacks at the signal:\n{text}")
    return "".join(texts)


def device_params(world_sizes=(1, 2, 4)):
    """pytest params (world_size, device): CPU/gloo always; CUDA/NCCL where enough GPUs exist."""
    import pytest
    import torch

    params = []
    for p in world_sizes:
        params.append(pytest.param(p, "cpu", id=f"p{p}-cpu"))
        enough = torch.cuda.is_available() and torch.cuda.device_count() >= p
        params.append(pytest.param(p, "cuda", id=f"p{p}-cuda", marks=pytest.mark.skipif(
            not enough, reason=f"needs {p} CUDA device(s); the CPU variant covers this case")))
    return params


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def local_device(device: str):
    """The device this rank computes on (cuda:r for NCCL ranks)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
