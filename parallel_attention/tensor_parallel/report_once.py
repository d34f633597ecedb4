"""Say an error that every rank found once, from rank 0, and make sure it is said before anyone exits.

torchrun stops every worker the moment one exits non-zero. A rank that finds the error first and leaves
at once can therefore take rank 0, still importing or reading, down with it before rank 0 has printed the
only report: the user then sees a SIGTERM and nothing else. So the other ranks wait for rank 0's word on
the launcher's store (torchrun's agent serves one at MASTER_ADDR:MASTER_PORT, before and after any
process group exists) and only then exit. A rank whose wait runs out says its own error, so that no
failure is silent even when rank 0 found none. Without a launcher store (a rank started by hand) rank 0
prints and the others return at once.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch.distributed as dist

_KEY = "parallel_attention/reported"


def _launcher_store(timeout_s: float) -> dist.Store | None:
    """A client of torchrun's store, or None where there is none (or it cannot be reached)."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except (RuntimeError, ValueError):  # DistStoreError is a RuntimeError
        return None


def report_from_rank_0(message: str, timeout_s: float = 30.0) -> None:
    """Rank 0 prints `message` to stderr; every other rank returns once it has (or says it itself after
    `timeout_s`). Call it on every rank just before exiting with an error that all ranks share."""
    rank = int(os.environ.get("RANK", "0"))
    key = f"{_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = _launcher_store(timeout_s)
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
        if store is not None:
            store.set(key, "1")
        return
    if store is None:
        return
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except RuntimeError:  # rank 0 did not report in time: it found no error, or died; say ours
        print(f"rank {rank}: {message}", file=sys.stderr, flush=True)
