"""Say an error that every rank found once, from rank 0, and make sure it is said before anyone exits.

torchrun stops every worker the moment one exits non-zero. A rank that finds the error first and leaves
at once can therefore take rank 0, still importing or reading, down with it before rank 0 has printed the
only report: the user then sees a SIGTERM and nothing else. So the other ranks wait for rank 0's word on
the launcher's store (torchrun's agent serves one at MASTER_ADDR:MASTER_PORT, before and after any
process group exists) and only then exit. A rank whose wait runs out, or that has no store to wait on (a
rendezvous backend whose agent serves none), says its own error, so that no failure is silent even when rank 0
found none. Outside torchrun (a rank started by hand) rank 0 prints and the others return at once.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch.distributed as dist

_KEY = "parallel_attention/reported"
_CONNECT_TIMEOUT_S = 10.0


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


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


def report_from_rank_0(message: str, timeout_s: float = 30.0) -> None:
    """Rank 0 prints `message` to stderr; every other rank returns once it has (or says it itself after
    `timeout_s`, or at once where there is no store to wait on). Call it on every rank just before exiting with
    an error that all ranks share. Outside torchrun (a rank started by hand) only rank 0 says anything."""
    rank = int(os.environ.get("RANK", "0"))
    # each agent counts its own restarts: a node that joined later waits out timeout_s, then speaks (harmless)
    key = f"{_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        print(message, file=sys.stderr, flush=True)  # first: nothing may delay the only report
        store = _launcher_store()  # None outside torchrun: only its agent sets TORCHELASTIC_USE_AGENT_STORE
        if store is not None:
            store.set(key, "1")
        return
    if not _under_torchrun():
        return
    store = _launcher_store()
    if store is None or not _reported(store, key, timeout_s):  # rank 0 found no error, died, or cannot be heard
        print(f"rank {rank}: {message}", file=sys.stderr, flush=True)


def _reported(store: dist.Store, key: str, timeout_s: float) -> bool:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except RuntimeError:  # DistStoreError: the wait timed out
        return False
    return True
