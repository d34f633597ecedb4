"""scripts/slurm/pretrain.sbatch without Slurm: fake `srun`, `scontrol` and `scancel` on PATH run the
script's per-node command as local torchrun agents (one per node, c10d rendezvous on the first), as
Slurm would, and record what the script asks of Slurm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import ROOT, free_port, metrics, torchrun, train_losses
from parallel_attention.checkpointing import list_checkpoints
from test_pretrain import data_dir, tiny_args  # noqa: F401 (data_dir is a fixture)
from tiny_run import reference_args

SBATCH = ROOT / "scripts" / "slurm" / "pretrain.sbatch"

# srun: the command once per node (SLURM_NNODES), as local processes with the node's ids; SIGTERM, as
# `scancel --signal=TERM JOB` delivers it, goes to every task.
FAKE_SRUN = f"""#!{sys.executable}
import os, signal, subprocess, sys
args = sys.argv[1:]
while args[0].startswith("-"):
    args.pop(0)
nodes = int(os.environ["SLURM_NNODES"])
tasks = [subprocess.Popen(args, env={{**os.environ, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n),
                                      "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0"}}) for n in range(nodes)]
signal.signal(signal.SIGTERM, lambda *_: [t.send_signal(signal.SIGTERM) for t in tasks if t.poll() is None])
with open(os.path.join(os.environ["FAKE_SLURM_DIR"], "srun.pid"), "w") as f:
    f.write(str(os.getpid()))
codes = [t.wait() for t in tasks]
sys.exit(next((c for c in codes if c != 0), 0))
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_SLURM_DIR/calls"
if [[ $1 == show && $2 == hostnames ]]; then printf 'localhost\\nlocalhost\\n'; fi
"""
FAKE_SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$FAKE_SLURM_DIR/calls"
kill -TERM "$(cat "$FAKE_SLURM_DIR/srun.pid")"
"""


@pytest.fixture
def fake_slurm(tmp_path) -> Path:
    bin_dir = tmp_path / "fake_slurm"
    bin_dir.mkdir()
    for name, text in {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL, "scancel": FAKE_SCANCEL}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _job_environment(fake_slurm: Path, run_dir: Path) -> dict:
    path = os.pathsep.join([str(fake_slurm), str(Path(sys.executable).parent), os.environ["PATH"]])
    return {**os.environ, "PATH": path, "FAKE_SLURM_DIR": str(fake_slurm), "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "tiny", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[01-02]",
            "GPUS_PER_NODE": "1", "CONFIG": "configs/gpt_tiny.yaml", "RUN_DIR": str(run_dir),
            "RDZV_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}


def _overrides(args: list[str]) -> list[str]:
    """pretrain.py's arguments without --config and --logging.run_dir, which the sbatch script sets."""
    return [a for a in args[2:] if not a.startswith("--logging.run_dir")]


def _calls(fake_slurm: Path) -> list[str]:
    return (fake_slurm / "calls").read_text().splitlines()


def test_sbatch_script_runs_two_agents_like_one(reference_run, shared_data, fake_slurm, tmp_path):
    """The reference run (one agent, two processes; tests/tiny_run.py) again as a Slurm job of two nodes."""
    run = tmp_path / "slurm_run"
    result = subprocess.run(["bash", str(SBATCH), *_overrides(reference_args(shared_data, run))], cwd=ROOT,
                            env=_job_environment(fake_slurm, run), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-6000:]
    assert "rendezvous localhost:" in result.stderr and "2 node(s) x 1 process(es)" in result.stderr
    single, multi = train_losses(reference_run.run), train_losses(run)
    assert sorted(multi) == sorted(single) == [1, 2, 3, 4, 5, 6]
    for step, loss in single.items():  # the same ranks and groups, only the rendezvous differs
        assert multi[step] == pytest.approx(loss, rel=1e-6), f"step {step}"
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_0000003", "step_0000006"]
    assert _calls(fake_slurm) == ["scontrol show hostnames node[01-02]"]  # no requeue after a normal end


@pytest.mark.slow  # CI keeps test_sbatch_script_runs_two_agents_like_one; SIGTERM -> checkpoint is test_pretrain's
def test_sigterm_to_the_batch_shell_checkpoints_and_requeues(data_dir, fake_slurm, tmp_path):  # noqa: F811
    run = tmp_path / "slurm_run"
    env = _job_environment(fake_slurm, run)
    args = tiny_args(data_dir, run, 2, 500, "--checkpoint.interval=1000")
    job = subprocess.Popen(["bash", str(SBATCH), *_overrides(args)],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (run / "metrics.jsonl").exists() or max(train_losses(run), default=0) < 2:
            assert job.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.5)
        job.send_signal(signal.SIGTERM)  # --signal=B:TERM@120: Slurm signals the batch shell only
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, stderr[-6000:]
    assert _calls(fake_slurm)[1:] == ["scancel --signal=TERM 4242", "scontrol requeue 4242"]
    saved = list_checkpoints(run / "checkpoints")
    assert len(saved) == 1
    stopped_at = int(saved[0].name.split("_")[1])
    assert 2 <= stopped_at < 500

    # the requeued job: same script, same run directory, resumes from that checkpoint by itself
    result = subprocess.run(["bash", str(SBATCH), *_overrides(tiny_args(data_dir, run, 2, stopped_at + 1))], cwd=ROOT,
                            env={**env, "RDZV_PORT": str(free_port())}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-6000:]
    assert f"at step {stopped_at}" in result.stderr
    assert [r["step"] for r in metrics(run) if "loss" in r][-1] == stopped_at + 1
