"""One run per run directory: an exclusive `flock` on RUN_DIR/.lock plus a lease file with a heartbeat.

Two runs on one directory (a scheduler requeue while the old job still runs, a relaunch by mistake) interleave
their metrics, configs and checkpoints, and every file still passes its checksum. Global rank 0 therefore takes
the lock before anything is written. `flock` is released by the kernel when its holder dies, but on some shared
filesystems (NFS without a lock daemon, some FUSE mounts) it does not exclude across hosts. So the holder also
keeps RUN_DIR/.lease.json (host, pid, start time, heartbeat), rewritten every HEARTBEAT_S by a daemon thread.

A lease is live while its process is alive (same host) and its heartbeat is younger than STALE_AFTER_S; a stale
one (a run killed without releasing it) is taken over with a warning naming it. A holder whose lease was taken
over stops at its next step (`ensure_held`) instead of writing beside the new owner.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
import uuid
import warnings
from datetime import datetime, timezone
from pathlib import Path

from ...checkpointing.tensor_io import write_atomic
from ..config.checks import ConfigError

LOCK_NAME, LEASE_NAME = ".lock", ".lease.json"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # ten missed heartbeats: a stopped (SIGSTOP) or partitioned holder, not a slow step


class RunDirInUseError(ConfigError):
    """Another live run holds `logging.run_dir`."""


def process_alive(pid: int) -> bool:
    """Whether a process of this host has `pid` (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _read_lease(path: Path) -> dict | None:
    try:
        lease = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return lease if isinstance(lease, dict) and {"host", "pid", "since", "heartbeat", "token"} <= lease.keys() else None


def describe(lease: dict) -> str:
    return f"pid {lease['pid']} on {lease['host']} since {lease['since']}"


def is_stale(lease: dict, now: float | None = None) -> bool:
    """Its process is gone (checked on its own host only) or it has not beaten within STALE_AFTER_S."""
    now = time.time() if now is None else now
    if lease["host"] == socket.gethostname() and not process_alive(int(lease["pid"])):
        return True
    return now - float(lease["heartbeat"]) > STALE_AFTER_S


class RunDirLock:
    """The lock and lease of one run directory, held by this process until `release()` (or its exit)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.lease_path = run_dir, run_dir / LEASE_NAME
        self.lease = {"host": socket.gethostname(), "pid": os.getpid(),
                      "since": datetime.now(timezone.utc).isoformat(timespec="seconds"), "heartbeat": time.time(),
                      "token": uuid.uuid4().hex}
        self._fd: int | None = None
        self._stop = threading.Event()
        self._lost: dict | None = None

    def acquire(self) -> None:
        """Take the flock, then the lease (taking over a stale one); RunDirInUseError names the live holder."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._in_use(_read_lease(self.lease_path)) from None
        held = _read_lease(self.lease_path)
        if held is not None and not is_stale(held):  # flock did not exclude it: a shared filesystem
            os.close(fd)
            raise self._in_use(held)
        if held is not None:
            warnings.warn(f"taking over the stale lease of logging.run_dir={str(self.run_dir)!r}: {describe(held)}, "
                          f"last heartbeat {time.time() - float(held['heartbeat']):.0f} s ago (that run is gone)",
                          RuntimeWarning, stacklevel=2)
        self._fd = fd
        self._write_lease()
        threading.Thread(target=self._beat, name="run-dir-heartbeat", daemon=True).start()

    def _in_use(self, holder: dict | None) -> RunDirInUseError:
        who = describe(holder) if holder else "another process (its lease is unreadable)"
        return RunDirInUseError(f"logging.run_dir={str(self.run_dir)!r} is in use by {who}. Two runs on one "
                                "directory would mix their metrics and checkpoints: wait for that run to end, stop "
                                "it, or point --logging.run_dir= at another directory.")

    def _write_lease(self) -> None:
        write_atomic(self.lease_path, [json.dumps(self.lease).encode("utf-8")])

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self._still_ours():
                return
            self.lease["heartbeat"] = time.time()
            try:
                self._write_lease()
            except OSError:  # a full or briefly unavailable filesystem: the next beat tries again
                pass

    def _still_ours(self) -> bool:
        current = _read_lease(self.lease_path)
        if current is not None and current["token"] != self.lease["token"]:
            self._lost = current
        return self._lost is None

    def ensure_held(self) -> None:
        """Raise (before this run writes again) if another run has taken the lease over."""
        if not self._still_ours():
            raise RunDirInUseError(f"logging.run_dir={str(self.run_dir)!r} was taken over by {describe(self._lost)}: "
                                   "this run stops without writing more. Check which of the two runs should "
                                   "continue; give the other its own --logging.run_dir=.")

    def release(self) -> None:
        """Stop the heartbeat, remove our lease (only if it is still ours) and drop the flock."""
        self._stop.set()
        if self._fd is None:
            return
        if self._still_ours():
            self.lease_path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None
