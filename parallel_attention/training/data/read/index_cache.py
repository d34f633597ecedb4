"""Cache directories built once per filesystem, by one process, and waited for by the others without a collective.

A cache is a directory `ROOT/NAME-DIGEST/` (DIGEST: of the key, everything its content depends on) whose
`info.json` is written last. One process takes `ROOT/.NAME-DIGEST.lock` (an exclusive create, which works across
the hosts of a shared filesystem), builds into `ROOT/.NAME-DIGEST.tmp-RANDOM/` and renames it into place: a killed
build leaves no half cache, only a temporary directory that the next build of that key deletes. Every other
process polls for `info.json` and prints what it waits for every REPORT_S seconds. A builder touches its lock as
it works; a lock untouched for STALE_S seconds is a dead builder's, and the next process in line builds instead.

The wait is no collective, so it is not bounded by parallel.timeout_s: indexing a corpus may take an hour while
the job's collectives keep a timeout of minutes. The ranks meet in a collective only once each has its cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from ....checkpointing.tensor_io import fsync_dir

__all__ = ["INFO", "POLL_S", "REPORT_S", "STALE_S", "Build", "claim", "wait_for"]

INFO = "info.json"
POLL_S = 0.5
REPORT_S = 30.0
STALE_S = 600.0


def _read_info(directory: Path, key: dict) -> dict | None:
    try:
        info = json.loads((directory / INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("key") == key else None


def claim(root: Path, name: str, key: dict, what: str) -> tuple[Path, dict | None, Build | None]:
    """(directory, info, None) of the cache of `key` under `root` when it is there or built by another process
    (waited for), else (directory, None, a Build) whose lock this process holds: the caller builds into
    `build.tmp` and hands the info to `build.store`, inside `with build:`. The cache never calls the builder back,
    so the caller keeps its own build code; `what` names the cache in messages."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:16]
    final, lock = root / f"{name}-{digest}", root / f".{name}-{digest}.lock"
    waiting = None
    while (info := _read_info(final, key)) is None:
        root.mkdir(parents=True, exist_ok=True)
        if _take(lock):
            if (info := _read_info(final, key)) is not None:  # built while we took the lock
                lock.unlink(missing_ok=True)
                return final, info, None
            return final, None, Build(final, key, lock, what)
        waiting = _wait(lock, what, waiting)
    return final, info, None


def wait_for(ready: Callable[[], bool], what: str) -> None:
    """Poll `ready()` until it holds, with no bound, saying every REPORT_S seconds that `what` is awaited."""
    began = reported = time.time()
    while not ready():
        if time.time() - reported >= REPORT_S:
            print(f"waiting {time.time() - began:.0f} s for {what} (no collective: parallel.timeout_s does not "
                  "bound it)", file=sys.stderr, flush=True)
            reported = time.time()
        time.sleep(POLL_S)


def _take(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{socket.gethostname()} pid {os.getpid()}\n")
    return True


def _wait(lock: Path, what: str, waiting: tuple[float, float] | None) -> tuple[float, float]:
    """Sleep one poll; (when the wait began, when it last reported). A stale lock is removed."""
    now = time.time()
    began, reported = waiting or (now, now)
    with contextlib.suppress(OSError):
        age = now - lock.stat().st_mtime
        if age > STALE_S:
            print(f"{what}: the build holding {lock} made no progress for {age:.0f} s (its process is gone); "
                  "building it here", file=sys.stderr, flush=True)
            lock.unlink(missing_ok=True)
            return began, now
        if now - reported >= REPORT_S:
            holder = lock.read_text(encoding="utf-8").strip()
            print(f"{what}: waiting {now - began:.0f} s for {holder} to build it (last progress {age:.0f} s ago; "
                  f"it is no collective, so parallel.timeout_s does not bound it)", file=sys.stderr, flush=True)
            reported = now
    time.sleep(POLL_S)
    return began, reported


class Build:
    """One build of a cache, by the holder of its lock: `tmp` to fill, `progress(text)` to call as it goes (it
    keeps the lock fresh and says how far it is), `store(info)` to put it in place; leaving `with` frees the lock
    and removes what a failed build left."""

    def __init__(self, final: Path, key: dict, lock: Path, what: str) -> None:
        for old in final.parent.glob(f".{final.name}.tmp-*"):  # a killed build's leftovers: only the lock holder
            shutil.rmtree(old, ignore_errors=True)
        self.final, self.key, self.lock, self.what = final, key, lock, what
        self.tmp = final.parent / f".{final.name}.tmp-{secrets.token_hex(6)}"
        self.tmp.mkdir()
        self.began = self.reported = time.time()

    def __enter__(self) -> Build:
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.lock.unlink(missing_ok=True)

    def progress(self, text: str) -> None:
        with contextlib.suppress(OSError):
            os.utime(self.lock)
        if time.time() - self.reported >= REPORT_S:
            print(f"{self.what}: building, {time.time() - self.began:.0f} s so far: {text}", file=sys.stderr,
                  flush=True)
            self.reported = time.time()

    def store(self, built: dict) -> dict:
        """Write `built` (with the key) as the cache's info and rename the directory into place; the info."""
        info = {**built, "key": self.key}
        with open(self.tmp / INFO, "w", encoding="utf-8") as f:  # no rename needed: tmp is private until renamed
            f.write(json.dumps(info, indent=1))
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.tmp)
        if self.final.exists():  # a damaged cache (files deleted by hand): replaced whole
            shutil.rmtree(self.final)
        os.rename(self.tmp, self.final)
        fsync_dir(self.final.parent)
        return info
