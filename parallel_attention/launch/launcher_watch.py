"""A worker dies with the torchrun launcher that started it.

torch elastic starts each worker in a session of its own (`start_new_session=True` in
torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py), so a `kill -9` of the
launcher, or of its process group, does not reach the workers: they would train on, and write checkpoints, for a
job that is gone. Under torchrun each worker therefore asks the kernel for SIGKILL when its parent dies
(`prctl(PR_SET_PDEATHSIG)`, Linux): it stops at once, and writes no checkpoint (the job is being torn down; the
last complete checkpoint stands). PDEATHSIG fires when the parent *thread* that forked the worker exits, not only
the process; torch elastic spawns every worker from the launcher's main thread (`agent.run()` in
launcher/api.py, down to `SubprocessHandler`'s Popen), which lives as long as the launcher. Where prctl is not
available, a daemon thread polls the parent pid instead (once a second).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_POLL_S = 1.0


def under_torchrun() -> bool:
    """Whether torch elastic started this process (its agent sets TORCHELASTIC_RUN_ID for every worker)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def stop_with_launcher() -> None:
    """Under torchrun: from this call on, this process is killed (SIGKILL) as soon as its launcher dies.
    Elsewhere (a process started by hand): nothing."""
    if not under_torchrun():
        return
    launcher = os.getppid()  # the parent at this call: a launcher already dead by then goes unnoticed
    if not _kill_on_parent_death():
        threading.Thread(target=_watch, args=(launcher,), name="launcher-watch", daemon=True).start()
    elif os.getppid() != launcher:  # the launcher died before the kernel was asked: no signal will come
        _die()


def _kill_on_parent_death() -> bool:
    """Ask the kernel for SIGKILL when the parent thread exits; False where prctl is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(_POLL_S)
    _die()


def _die() -> None:
    os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))  # no SIGKILL on Windows
