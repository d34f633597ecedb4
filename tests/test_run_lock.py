"""One run per run directory: the lock and its lease, what a stale lease means, and what the lock holder may
delete (a dead run's temporaries) and never deletes (another save's temporary, an incomplete step_N)."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
import warnings

import pytest

from parallel_attention.checkpointing.checkpoint import load_newest_valid
from parallel_attention.checkpointing.format import prune
from parallel_attention.training.run import run_lock
from parallel_attention.training.run.run_dir import remove_leftovers
from parallel_attention.training.run.run_lock import RunDirInUseError, RunDirLock


def _write_lease(run_dir, pid: int, heartbeat: float, host: str | None = None) -> None:
    lease = {"host": host or socket.gethostname(), "pid": pid, "since": "2026-12-01T00:00:00+00:00",
             "heartbeat": heartbeat, "token": "someone-else"}
    (run_dir / run_lock.LEASE_NAME).write_text(json.dumps(lease))


def _dead_pid() -> int:
    child = multiprocessing.get_context("spawn").Process(target=int)
    child.start()
    child.join()
    return child.pid


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    first = RunDirLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(RunDirInUseError, match=rf"logging.run_dir='{tmp_path}' is in use by pid {os.getpid()} "
                                                   rf"on {socket.gethostname()} since 20\d\d-"):
            RunDirLock(tmp_path).acquire()  # a second open file: flock refuses it, as it would another process
    finally:
        first.release()
    assert not (tmp_path / run_lock.LEASE_NAME).exists()
    again = RunDirLock(tmp_path)
    again.acquire()  # released: free again
    again.release()


def test_a_live_lease_refuses_even_where_flock_does_not_exclude(tmp_path):
    """A shared filesystem whose flock does not reach the other host: the lease alone refuses."""
    _write_lease(tmp_path, os.getpid(), time.time(), host="another-node")
    with pytest.raises(RunDirInUseError, match="in use by pid .* on another-node"):
        RunDirLock(tmp_path).acquire()


@pytest.mark.parametrize("why", ["dead process", "no heartbeat"])
def test_a_stale_lease_is_taken_over_with_a_warning_naming_it(tmp_path, why):
    if why == "dead process":
        pid, heartbeat, host = _dead_pid(), time.time(), None
    else:  # alive somewhere, but silent for longer than the bound
        pid, heartbeat, host = 4242, time.time() - run_lock.STALE_AFTER_S - 1, "another-node"
    _write_lease(tmp_path, pid, heartbeat, host)
    lock = RunDirLock(tmp_path)
    with pytest.warns(RuntimeWarning, match=f"taking over the stale lease .*pid {pid} on "):
        lock.acquire()
    assert json.loads((tmp_path / run_lock.LEASE_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_holder_whose_lease_was_taken_over_stops(tmp_path):
    lock = RunDirLock(tmp_path)
    lock.acquire()
    lock.ensure_held()
    _write_lease(tmp_path, 4242, time.time(), host="another-node")  # another run took it over
    with pytest.raises(RunDirInUseError, match="was taken over by pid 4242 on another-node"):
        lock.ensure_held()
    lock.release()
    assert (tmp_path / run_lock.LEASE_NAME).exists(), "the new owner's lease is not ours to remove"


def test_the_heartbeat_refreshes_the_lease(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = RunDirLock(tmp_path)
    lock.acquire()
    first = json.loads((tmp_path / run_lock.LEASE_NAME).read_text())["heartbeat"]
    deadline = time.monotonic() + 10
    while json.loads((tmp_path / run_lock.LEASE_NAME).read_text())["heartbeat"] == first:
        assert time.monotonic() < deadline, "no heartbeat"
        time.sleep(0.05)
    lock.release()


def test_prune_leaves_another_saves_temporary_alone(tmp_path):
    foreign = tmp_path / "step_0000016.tmp-0123456789ab"  # another writer's, about to be renamed into place
    own = tmp_path / "step_0000015.tmp-delete-feedfacecafe"  # this save's retired directory
    for d in (foreign, own):
        d.mkdir()
        (d / "model_tp00.safetensors").write_bytes(b"x")
    prune(tmp_path, None, tmp_path / "step_0000017", "feedfacecafe")
    assert foreign.is_dir() and (foreign / "model_tp00.safetensors").exists()
    assert not own.exists()


def test_the_lock_holder_removes_a_dead_runs_temporaries_and_says_so(tmp_path, capsys):
    checkpoints = tmp_path / "checkpoints"
    partial = checkpoints / "step_0000040.tmp-0123456789ab"
    partial.mkdir(parents=True)
    (partial / "model_tp00.safetensors").write_bytes(b"\0" * 2_000_000)
    (checkpoints / "step_0000035").mkdir()  # a step directory is never a leftover, even an empty one
    (tmp_path / "metrics.jsonl.tmp").write_text("{")
    remove_leftovers(tmp_path)
    assert not partial.exists() and not (tmp_path / "metrics.jsonl.tmp").exists()
    assert (checkpoints / "step_0000035").is_dir()
    said = capsys.readouterr().err
    assert "removed 2 leftover temporaries of an earlier run (2.0 MB)" in said and partial.name in said, said


def test_an_incomplete_step_directory_is_reported_and_skipped(tmp_path):
    (tmp_path / "step_0000016").mkdir()  # empty: what a prune racing a rename left
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_newest_valid(tmp_path, lambda path: pytest.fail(f"loaded {path}")) is None
    assert any("skipping incomplete checkpoint" in str(w.message) and "step_0000016" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
