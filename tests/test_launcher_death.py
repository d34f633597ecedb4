"""A SIGKILL of the torchrun launcher alone stops its workers at once (parallel_attention/launch/launcher_watch.py):
torch elastic starts each worker in a session of its own, so nothing else would reach them."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launch import ROOT, environment, torchrun_command
from test_pretrain import data_dir, tiny_args  # noqa: F401 (data_dir is a fixture)

pytestmark = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the workers through /proc")

STOP_WITHIN_S = 30.0  # the acceptance bound; with the watch the workers are gone within milliseconds
GRACE_S = 3.0  # more than the few steps per second the tiny model trains: an unstopped worker logs within it


def workers_marked(marker: str) -> list[int]:
    """Live processes other than this one whose command line holds `marker` (the test's own run directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def _step_rows(run: Path) -> int:
    """Complete step rows of RUN/metrics.jsonl (a line still being written is not one yet)."""
    path = run / "metrics.jsonl"
    lines = path.read_text(encoding="utf-8").split("\n")[:-1] if path.exists() else []
    return sum('"loss"' in line for line in lines)


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_workers_stop_when_the_launcher_is_killed(data_dir, tmp_path):  # noqa: F811
    run = tmp_path / "launcher_death_run"
    command = torchrun_command("pretrain.py", 2, tiny_args(data_dir, run, 1, 100_000, "--checkpoint.interval=100000"))
    launcher = subprocess.Popen(command, cwd=ROOT, env=environment(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while _step_rows(run) == 0:
            assert launcher.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        assert len(workers_marked(str(run))) >= 2, "the workers were not found by their command line"
        os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone, not its process group
        launcher.wait(timeout=30)
        rows = _step_rows(run)
        deadline = time.monotonic() + STOP_WITHIN_S
        while workers_marked(str(run)) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = workers_marked(str(run))
        assert not alive, f"workers {alive} still running {STOP_WITHIN_S:.0f} s after the launcher was killed"
        time.sleep(GRACE_S)
        assert _step_rows(run) == rows, "a worker logged a step after its launcher was killed"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        kill_all(workers_marked(str(run)))
