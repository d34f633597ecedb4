"""End to end under torchrun: a second run on a live run directory is refused before it writes anything, the
first run finishes whole, and a refused resume leaves config.yaml as it was, said in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from launch import ROOT, environment, metrics, torchrun, torchrun_command
from test_hang import _wait_for_step
from test_launcher_death import workers_marked
from test_pretrain import data_dir, tiny_args  # noqa: F401  (data_dir is a fixture)

from parallel_attention.checkpointing.format import list_checkpoints


def _package_frames(stderr: str) -> list[str]:
    """Traceback lines in our code (torchrun prints its own traceback for any failed worker: that one is not ours)."""
    return [line for line in stderr.splitlines() if line.lstrip().startswith("File ") and "parallel_attention" in line
            or "scripts/pretrain.py" in line and line.lstrip().startswith("File ")]


STEPS = 40  # far from done when step 2 is seen (polled every 0.2 s), held still from there


def test_a_second_run_is_refused_and_the_first_finishes_whole(data_dir, tmp_path):  # noqa: F811
    """The first run is held still (SIGSTOP, agent and workers, lock and lease kept) while the second launches, so
    it is live however long the second takes to start; a second run that waited for the lock would never end."""
    run = tmp_path / "run"
    args = tiny_args(data_dir, run, 2, STEPS, "--checkpoint.interval=20", "--training.eval_interval=100")
    first = subprocess.Popen(torchrun_command("pretrain.py", 2, args), cwd=ROOT, env=environment(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(run, 2, time.monotonic() + 180)
        held = workers_marked(str(run))  # torchrun's agent and its two workers
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        try:
            second = torchrun("pretrain.py", 2, [*args, "--training.seed=777"], timeout=120, check=False)
        finally:
            for pid in held:
                os.kill(pid, signal.SIGCONT)
        _, first_err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert len(held) >= 2 and second.returncode != 0, (held, second.returncode)
    assert f"config error: logging.run_dir='{run}' is in use by pid " in second.stderr, second.stderr[-3000:]
    assert not _package_frames(second.stderr), second.stderr[-3000:]
    assert first.returncode == 0, first_err[-3000:]
    steps = [r["step"] for r in metrics(run)]
    assert steps == list(range(STEPS + 1)), steps  # one row per step, the initial evaluation's included
    written = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert written == [p.name for p in list_checkpoints(run / "checkpoints")], written  # every one complete
    assert "seed: 1234" in (run / "config.yaml").read_text()

    config = (run / "config.yaml").read_bytes()
    refused = torchrun("pretrain.py", 2, [*args, "--resume", "--model.num_layers=3"], timeout=180, check=False)
    assert refused.returncode != 0
    lines = [line for line in refused.stderr.splitlines() if line.startswith("config error: cannot resume")]
    assert len(lines) == 1 and "num_layers" in lines[0], refused.stderr[-3000:]
    assert not _package_frames(refused.stderr), refused.stderr[-3000:]
    assert (run / "config.yaml").read_bytes() == config, "a refused resume rewrote config.yaml"
