"""Cache directories built once per filesystem, by one process, and waited for by the others without a collective.

A cache is a directory `ROOT/NAME-DIGEST/` (DIGEST: of the key, everything its content depends on) whose
`info.json` is written last. One process takes `ROOT/.NAME-DIGEST.lock` (an exclusive create, which works across
the hosts of a shared filesystem), builds into `ROOT/.NAME-DIGEST.tmp-RANDOM/` and renames it into place: a killed
build leaves no half cache, only a temporary directory that the next build of that key deletes. Every other
process polls for `info.json` and prints what it waits for every REPORT_S seconds. A builder touches its lock as
it works; a lock that names this host and a pid that is gone (a SIGKILL, an OOM kill) is taken over at once, and one
untouched for STALE_S seconds (a builder on another host that died) by the next process in line.

A build that fails leaves `ROOT/.NAME-DIGEST.failed`, its message (the cause, e.g. no space left, and the setting
to change): every process that was waiting raises it too instead of building again in turn, and the next claim of
the key removes it. Once a cache is built, those of the same source that it supersedes are deleted
(`drop_superseded`). A cache also keeps small records that its readers add to (`remember_verified`: the chunks of a
token file already verified, trusted as the cache is).

The wait is no collective, so it is not bounded by parallel.timeout_s: indexing a corpus may take an hour while
the job's collectives keep a timeout of minutes. The ranks meet in a collective only once each has its cache.
"""

from __future__ import annotations

import contextlib
import errno
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
from ...run.run_lock import process_alive
from ..token_files import DataFileError

__all__ = ["FAILED", "INFO", "POLL_S", "REPORT_S", "STALE_S", "Build", "CacheWriteError", "cache_directory", "claim",
           "drop_superseded", "found", "read_verified", "remember_verified", "wait_for"]

INFO = "info.json"
FAILED = ".failed"  # suffix of a failed build's marker, beside its lock
_UNWRITABLE = "[cannot write] "  # a marker's first words when its root could not be written
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}


class CacheWriteError(DataFileError):
    """A cache that could not be written where it was to go (no space left, no permission): another root may do."""
POLL_S = 0.5
REPORT_S = 30.0
STALE_S = 600.0


def _read_info(directory: Path, key: dict | None) -> dict | None:
    """The cache's info.json when it is complete and of `key` (None: of any key)."""
    try:
        info = json.loads((directory / INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and (key is None or info.get("key") == key) else None


def cache_directory(root: Path, name: str, key: dict) -> Path:
    """`ROOT/NAME-DIGEST`, where the cache of `key` lives."""
    return root / f"{name}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode('utf-8')).hexdigest()[:16]}"


def found(root: Path, name: str, key: dict) -> dict | None:
    """The info of the complete cache of `key` under `root`, or None: a read, never a lock."""
    return _read_info(cache_directory(root, name, key), key)


def claim(root: Path, name: str, key: dict, what: str) -> tuple[Path, dict | None, Build | None]:
    """(directory, info, None) of the cache of `key` under `root` when it is there or built by another process
    (waited for), else (directory, None, a Build) whose lock this process holds: the caller builds into
    `build.tmp` and hands the info to `build.store`, inside `with build:`. The cache never calls the builder back,
    so the caller keeps its own build code; `what` names the cache in messages. DataFileError with the builder's
    message when the build this process waited for failed."""
    final = cache_directory(root, name, key)
    lock, failed = root / f".{final.name}.lock", root / f".{final.name}{FAILED}"
    waiting = None
    while (info := _read_info(final, key)) is None:
        if waiting is not None:
            _raise_if_failed(failed, waiting[0], what)
        root.mkdir(parents=True, exist_ok=True)
        if _take(lock):
            if waiting is not None:  # the build waited for may have failed between the check above and the take
                try:
                    _raise_if_failed(failed, waiting[0], what)
                except DataFileError:
                    lock.unlink(missing_ok=True)
                    raise
            failed.unlink(missing_ok=True)  # an earlier start's failure: this build tries again
            if (info := _read_info(final, key)) is not None:  # built while we took the lock
                lock.unlink(missing_ok=True)
                return final, info, None
            return final, None, Build(final, key, lock, what)
        waiting = _wait(lock, what, waiting)
    return final, info, None


def _raise_if_failed(failed: Path, began: float, what: str) -> None:
    """DataFileError with the message of a build that failed while this process waited for it."""
    try:
        if failed.stat().st_mtime < began - 2.0:  # an older start's (the clock of a shared filesystem may lag)
            return
        text = failed.read_text(encoding="utf-8").strip()
    except OSError:
        return
    if text.startswith(_HOLDER):  # the builder could not write why: its lock, renamed
        raise CacheWriteError(f"{what} could not be built by {text[len(_HOLDER):]} under {failed.parent}, which could "
                              "not record why (no space left or no permission there, as a rule; its own output says): "
                              "free space there, or set data.index_cache to a writable directory with room")
    if text.startswith(_UNWRITABLE):
        raise CacheWriteError(text[len(_UNWRITABLE):])
    raise DataFileError(text)


def wait_for(ready: Callable[[], bool], what: str) -> None:
    """Poll `ready()` until it holds, with no bound, saying every REPORT_S seconds that `what` is awaited."""
    began = reported = time.time()
    while not ready():
        if time.time() - reported >= REPORT_S:
            print(f"waiting {time.time() - began:.0f} s for {what} (no collective: parallel.timeout_s does not "
                  "bound it)", file=sys.stderr, flush=True)
            reported = time.time()
        time.sleep(POLL_S)


_HOLDER = "holder "  # a lock's first word: "holder HOST pid PID"


def _take(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{_HOLDER}{socket.gethostname()} pid {os.getpid()}\n")
    return True


def _dead_holder(text: str) -> bool:
    """Whether a lock's text ("holder HOST pid PID", or an earlier release's "HOST pid PID") names this host and a
    process that is gone."""
    words = text.removeprefix(_HOLDER).split()
    if len(words) != 3 or words[1] != "pid" or not words[2].isdigit():
        return False
    return words[0] == socket.gethostname() and not process_alive(int(words[2]))


def _wait(lock: Path, what: str, waiting: tuple[float, float] | None) -> tuple[float, float]:
    """Sleep one poll; (when the wait began, when it last reported). A dead builder's lock is removed."""
    now = time.time()
    began, reported = waiting or (now, now)
    with contextlib.suppress(OSError):
        age, holder = now - lock.stat().st_mtime, lock.read_text(encoding="utf-8").strip()
        dead = _dead_holder(holder)
        if dead or age > STALE_S:
            why = "its process is gone" if dead else f"it made no progress for {age:.0f} s"
            print(f"{what}: taking over {lock} ({holder.removeprefix(_HOLDER)}: {why}); building it here",
                  file=sys.stderr, flush=True)
            lock.unlink(missing_ok=True)
            return began, now
        if now - reported >= REPORT_S:
            print(f"{what}: waiting {now - began:.0f} s for {holder.removeprefix(_HOLDER)} to build it (last "
                  f"progress {age:.0f} s ago; it is no collective, so parallel.timeout_s does not bound it)",
                  file=sys.stderr, flush=True)
            reported = now
    time.sleep(POLL_S)
    return began, reported


def drop_superseded(directory: Path, key: dict, same: tuple[str, ...]) -> list[Path]:
    """Delete the complete caches beside `directory` (the one just built for `key`) whose key agrees with `key` on
    the fields `same` (the source, as a rule) and differs elsewhere (the files changed, another layout version):
    their successor is built, and nothing reads them again. A run still mapping one keeps its pages (POSIX unlinks
    only the names). Returns what it deleted."""
    gone = []
    for other in directory.parent.glob(f"{directory.name.rsplit('-', 1)[0]}-*"):
        info = _read_info(other, None) if other != directory and other.is_dir() else None
        old = (info or {}).get("key")
        if isinstance(old, dict) and old != key and all(old.get(field) == key.get(field) for field in same):
            shutil.rmtree(other, ignore_errors=True)
            gone.append(other)
    return gone


def read_verified(path: Path | None, count: int) -> set[int]:
    """The chunks a cache records as verified at `path` (source_index.ChunkVerifier); none without a readable record."""
    try:
        chunks = json.loads(path.read_text(encoding="utf-8")) if path is not None else []
    except (OSError, ValueError):
        return set()
    return {c for c in chunks if isinstance(c, int) and 0 <= c < count} if isinstance(chunks, list) else set()


def remember_verified(path: Path | None, verified: set[int]) -> None:
    """Add `verified` to the record at `path`, atomically (ranks may write at once: a lost update only means a
    chunk hashed again); a read-only cache keeps no record."""
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(6)}")
    try:
        tmp.write_text(json.dumps(sorted(verified | read_verified(path, 1 << 62))), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


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

    def __exit__(self, kind, error, traceback) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        if not isinstance(error, Exception):  # done, or interrupted (a signal): nothing to report to the waiters
            self.lock.unlink(missing_ok=True)
            return
        if isinstance(error, ValueError):  # the data's own fault (an .idx that fails its hash): said as it is
            self._leave_failure(str(error))
            return
        message = self._failure(error)
        unwritable = getattr(error, "errno", None) in _WRITE_ERRNOS
        self._leave_failure(_UNWRITABLE + message if unwritable else message)
        raise (CacheWriteError if unwritable else DataFileError)(message) from error

    def _failure(self, error: BaseException) -> str:
        """The message of a build that failed for the filesystem (no space left, no permission) or another cause."""
        root = self.final.parent
        return (f"{self.what} could not be built under {root} ({type(error).__name__}: {error}): "
                + ("no space is left there" if getattr(error, "errno", None) == errno.ENOSPC else
                   "it cannot be written there" if getattr(error, "errno", None) in (errno.EACCES, errno.EPERM,
                                                                                   errno.EROFS) else "the build failed")
                + ". Free space there or fix its permissions, or set data.index_cache to a writable directory with "
                  "room (a Megatron-LM prefix's index goes there, and a prepared directory's that cannot be written "
                  "in the directory itself)")

    def _leave_failure(self, message: str) -> None:
        """The marker the waiters read, then the lock freed; on a full disk, the lock renamed to it (no space)."""
        failed = self.lock.parent / f".{self.final.name}{FAILED}"
        try:
            failed.write_text(message, encoding="utf-8")
        except OSError:
            with contextlib.suppress(OSError):
                os.rename(self.lock, failed)
                os.utime(failed)  # the failure's time, which the waiters compare with their own start
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
