"""Say an error that every rank found once, from rank 0, before anything else, and have torchrun's own report
name it as the root cause.

torchrun stops every worker the moment one exits non-zero. A rank that finds the error first and leaves
at once can therefore take rank 0, still importing or reading, down with it before rank 0 has printed the
only report: the user then sees a SIGTERM and nothing else. So the other ranks wait for rank 0's word on
the launcher's store (torchrun's agent serves one at MASTER_ADDR:MASTER_PORT, before and after any
process group exists) and only then exit. A rank whose wait runs out, or that has no store to wait on (a
rendezvous backend whose agent serves none), says its own error, so that no failure is silent even when rank 0
found none. Outside torchrun (a rank started by hand) rank 0 prints and the others return at once.

After the line, torchrun prints its own `ChildFailedError` report and exits 1, whatever status its workers
chose: only the launcher decides that. The report names the first worker that failed as the root cause, with
what that worker wrote to its error file (TORCHELASTIC_ERROR_FILE, where `torch.distributed.elastic`'s `@record`
writes). So every rank that speaks writes its line there, the others write that they stopped on rank 0's
error, rank 0 exits once every rank has come this far (all of them then exit with the caller's status, none is
killed half-way), and the ranks on rank 0's node leave only on the SIGTERM that torchrun's agent sends when it
has seen rank 0 exit: rank 0, with our line, is the root cause.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from .launcher_watch import under_torchrun

_KEY = "parallel_attention/reported"
_CONNECT_TIMEOUT_S = 10.0
_OUTLIVE_RANK_0_S = 10.0  # rank 0 only has to tear its interpreter down; the agent then stops the others at once


def _launcher_store() -> dist.Store | None:
    """A client of the store torchrun's agent serves to its workers, or None where it serves none
    (TORCHELASTIC_USE_AGENT_STORE unset: another rendezvous backend, or the shared store switched off) or it
    cannot be reached."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ:
        return None
    try:
        return dist.TCPStore(os.environ.get("MASTER_ADDR", "localhost"), int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=timedelta(seconds=_CONNECT_TIMEOUT_S), wait_for_workers=False)
    except (RuntimeError, ValueError):  # DistStoreError is a RuntimeError
        return None


def report_from_rank_0(message: str, exit_status: int = 2, timeout_s: float = 30.0) -> None:
    """Rank 0 prints `message` to stderr; every other rank returns once it has (or says it itself after
    `timeout_s`, or at once where there is no store to wait on). Call it on every rank just before exiting with
    `exit_status` for an error that all ranks share. Outside torchrun (a rank started by hand) only rank 0 says
    anything. Under torchrun rank 0 returns once every rank has come here (or after `timeout_s`), and the
    others on its node leave from here, with SystemExit(exit_status), when torchrun stops them after it."""
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    # each agent counts its own restarts: a node that joined later waits out timeout_s, then speaks (harmless)
    key = f"{_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    node = os.environ.get("GROUP_RANK", "0")
    if rank == 0:
        print(message, file=sys.stderr, flush=True)  # first: nothing may delay the only report
        write_error_file(message)
        store = _launcher_store()  # None outside torchrun: only its agent sets TORCHELASTIC_USE_AGENT_STORE
        if store is not None:
            store.set(key, node)  # said, and on which node
            _wait(store, [f"{key}/{r}" for r in range(1, world_size)], timeout_s)  # exit last-but-first: below
        return
    if not under_torchrun():
        return
    store = _launcher_store()
    if store is not None:
        store.set(f"{key}/{rank}", "here")
    if store is None or not _wait(store, [key], timeout_s):  # rank 0 found no error, died, or cannot be heard
        print(f"rank {rank}: {message}", file=sys.stderr, flush=True)
        write_error_file(f"rank {rank}: {message}")
        return
    write_error_file(f"rank {rank}: the same error as rank 0")
    if store.get(key).decode() == node:
        _outlive_rank_0(exit_status)


def record_errors(main: Callable[..., int]) -> Callable[..., int]:
    """An entry point's `main` that, when an exception escapes it, first writes `<Type>: <message> (raised at
    file:line)` to torchrun's error file, then lets it go on (Python prints the traceback on the rank's stderr).
    torchrun's report then names that line as the root cause, where it said only "To enable traceback see ..."
    (and where torch's own `@record` would paste the whole traceback into the report). The refusals an entry point
    catches are written by `report_from_rank_0`; this covers the ones it does not."""
    @functools.wraps(main)
    def recorded(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except Exception as error:
            where = traceback.extract_tb(error.__traceback__)[-1]
            write_error_file(f"{type(error).__name__}: {error} (raised at {Path(where.filename).name}:{where.lineno}"
                             f" in {where.name}; the traceback is in this rank's output)")
            raise
    return recorded


def write_error_file(message: str) -> None:
    """Put `message` in torchrun's error file for this worker (nothing outside torchrun), in the layout its
    `ProcessFailure` reads: its report then shows `traceback : <message>` for this rank."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    error = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(error, f)
    except OSError:  # the report then lacks our line; the line itself was printed already
        pass


def _wait(store: dist.Store, keys: list[str], timeout_s: float) -> bool:
    """Whether all `keys` were set within `timeout_s`."""
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError:  # DistStoreError: the wait timed out
        return False
    return True


def _outlive_rank_0(exit_status: int) -> None:
    """Wait for the SIGTERM that torchrun's agent sends once rank 0 has exited, and leave on it with
    `exit_status`: the agent then sees rank 0 fail first and names it, whose error file holds the message, as
    the root cause. Leaves anyway after _OUTLIVE_RANK_0_S (rank 0 stuck in its teardown)."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers belong to the main thread

    def leave(signum, frame):
        raise SystemExit(exit_status)

    previous = signal.signal(signal.SIGTERM, leave)
    try:
        time.sleep(_OUTLIVE_RANK_0_S)
    finally:
        signal.signal(signal.SIGTERM, previous)
