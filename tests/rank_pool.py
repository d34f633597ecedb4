"""Gloo ranks that stay up between calls, for property tests that run many small cases.

`RankPool(world_size)` spawns `world_size` ranks once (tensor-parallel size = world size) on the
first `run`; `pool.run(fn, *args)` then runs fn(*args) on every rank and returns the per-rank results,
like `run_distributed` but without paying for process start-up and group creation on every call.
A rank's exception is re-raised in the parent; a crash or a hang past `timeout` closes the pool (its
group is no longer usable) and the next `run` starts a fresh one. `close` kills the ranks. `fn` must be a module-level function.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import traceback

from distributed import DEFAULT_TIMEOUT_S, _collect, enable_crash_log, preloaded_context


def _serve(rank, world_size, init_file, inbox, results, timeout):
    import torch
    import torch.distributed as dist

    enable_crash_log(init_file, rank)
    torch.set_num_threads(1)  # ranks share two cores: do not oversubscribe them
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    _initialize(world_size)
    while True:  # until the pool kills this process
        fn, args, reset_tp = inbox.get()
        try:
            if reset_tp is not None:
                _reset(reset_tp)
            results.put((rank, True, pickle.dumps(fn(*args))))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))


# torch's default generator seed in a fresh process (torch.initial_seed() before any manual_seed)
_FRESH_SEED = 67280421310721


# the model-parallel state _initialize made last, and its tp size
_MADE: dict = {}


def _initialize(tp_size: int) -> None:
    import parallel_attention as pa
    from parallel_attention.tensor_parallel import parallel_state

    pa.destroy_model_parallel()
    pa.initialize_model_parallel(tp_size)
    _MADE.update(state=parallel_state._STATE, tp_size=tp_size)


def _reset(tp_size: int) -> None:
    """What a freshly spawned rank would hold: default seed and dtype, gradients on, and the model-parallel
    groups of `tp_size`: `initialize_model_parallel(tp_size)`'s, kept where the last test left them as made (a
    test that re-initialized with a cp size, or from a mesh of its own, leaves another state, made again here;
    creating gloo groups costs a connection round)."""
    import torch

    from parallel_attention.tensor_parallel import collective_log, parallel_state, rng

    torch.manual_seed(_FRESH_SEED)
    rng._tp_states.clear()
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    collective_log.disable_collective_log()
    if parallel_state._STATE is not _MADE["state"] or _MADE["tp_size"] != tp_size:
        _initialize(tp_size)


class RankPool:
    def __init__(self, world_size: int, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.world_size, self.timeout = world_size, timeout
        self._procs: list = []

    def _start(self) -> None:
        ctx = preloaded_context()
        self._tmp = tempfile.TemporaryDirectory()
        self._results, self._inboxes = ctx.Queue(), [ctx.Queue() for _ in range(self.world_size)]
        init_file = self._init_file = os.path.join(self._tmp.name, "store")
        self._procs = [ctx.Process(target=_serve, daemon=True, args=(r, self.world_size, init_file, self._inboxes[r],
                                                                     self._results, self.timeout))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args) -> list:
        """fn(*args) on every rank, in the state the previous calls left."""
        return self._run(fn, args, None)

    def run_reset(self, fn, tp_size: int, *args, timeout: float | None = None) -> list:
        """fn(*args) on every rank, after resetting each rank to a fresh process's state (`_reset`)."""
        return self._run(fn, args, tp_size, timeout)

    def _run(self, fn, args, reset_tp, timeout: float | None = None) -> list:
        if not self._procs:
            self._start()
        for inbox in self._inboxes:
            inbox.put((fn, args, reset_tp))
        try:
            results = _collect(self._procs, self._results, timeout or self.timeout, self._init_file)
        except BaseException:
            self.close()  # the other ranks may wait in a collective forever
            raise
        if max(_threads(p.pid) for p in self._procs) > MAX_THREADS:
            self.close()  # the next run starts fresh ranks
        return results

    def close(self) -> None:
        """Kill the ranks: nothing they hold outlives the pool, and a rank may be stuck in a collective."""
        for p in self._procs:
            p.kill()
            p.join(5)
        if self._procs:
            self._tmp.cleanup()
        self._procs = []


# Every gloo group a test creates keeps a polling thread until its process ends: past this many threads a
# rank spends its time waking them (measured: 1,072 threads, each rank at ~28 % of a core while idle).
MAX_THREADS = 160


def _threads(pid: int) -> int:
    """The threads of process `pid` (0 where /proc is missing)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


_REUSED: dict[int, RankPool] = {}


def reused_ranks(world_size: int) -> RankPool:
    """The ranks run_distributed reuses for this world size (started on first use; their groups keep the
    default timeout, while each call waits for its own)."""
    return _REUSED.setdefault(world_size, RankPool(world_size))
