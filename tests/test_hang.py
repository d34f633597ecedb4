"""A rank that stops answering (SIGSTOP: a hung GPU, a frozen node) ends the whole job with a
non-zero exit within parallel.timeout_s + 60 s, and the error names the operation and the group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from launch import ROOT, environment, torchrun_command
from test_pretrain import data_dir, tiny_args  # noqa: F401  (data_dir is a fixture)

TIMEOUT_S = 10


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _wait_for_step(run_dir, step: int, deadline: float) -> None:
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and any(json.loads(line).get("step", 0) >= step and "loss" in json.loads(line)
                                    for line in metrics.read_text().splitlines() if line.strip()):
            return
        time.sleep(0.2)
    raise AssertionError(f"the run never reached step {step}")


@pytest.mark.slow  # CI keeps tests/test_timeouts.py (the same timeouts, FSDP2's included, in-process)
@pytest.mark.parametrize("tp,zero_stage,group", [(2, 0, "tensor-parallel group"), (1, 3, "data-parallel group")],
                         ids=["tp2", "fsdp2_dp2"])
def test_a_stopped_rank_fails_the_job_within_the_timeout(data_dir, tmp_path, tp, zero_stage, group):  # noqa: F811
    run = tmp_path / "run"
    args = tiny_args(data_dir, run, tp, 100000, f"--parallel.timeout_s={TIMEOUT_S}", "--checkpoint.interval=100000",
                     f"--parallel.zero_stage={zero_stage}")
    agent = subprocess.Popen(torchrun_command("pretrain.py", 2, args), cwd=ROOT, env=environment(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(run, 2, time.monotonic() + 120)
        workers = _children(agent.pid)
        assert len(workers) == 2, workers
        os.kill(max(workers), signal.SIGSTOP)  # the second worker freezes mid-run
        stopped_at = time.monotonic()
        _, stderr = agent.communicate(timeout=TIMEOUT_S + 90)
        waited = time.monotonic() - stopped_at
    finally:
        for pid in _children(agent.pid):
            os.kill(pid, signal.SIGKILL)
        agent.kill()
    assert agent.returncode != 0
    assert waited < TIMEOUT_S + 60, waited
    # FSDP2: its all-gathers and reduce-scatters are named too (CollectiveTimeoutError, not gloo's bare timeout)
    assert "CollectiveTimeoutError" in stderr and "did not complete within the timeout" in stderr, stderr[-3000:]
    assert group in stderr, stderr[-3000:]
