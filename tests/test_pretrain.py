"""End to end under torchrun: losses independent of the parallel layout, exact resume, fallback past
a corrupt checkpoint, SIGTERM and Ctrl-C, multi-node rendezvous. (Generation with and without the KV cache, from
the same reference run, is tests/test_reshard.py's.)"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launch import ROOT, environment, free_port, metrics, torchrun, torchrun_command, train_losses
from parallel_attention.checkpointing import list_checkpoints
from tiny_run import DROPOUT, MAX_BYTES, VAL_FRACTION, copy_run, reference_args, tiny_args  # noqa: F401 (re-exported)


@pytest.fixture(scope="module")
def data_dir(shared_data) -> Path:
    """The session's prepared data (tests/conftest.py), under the name the end-to-end files import from here."""
    return shared_data


def test_losses_do_not_depend_on_the_parallel_layout(data_dir, tmp_path):
    """pretrain.py end to end: one rank against tensor, data and sequence parallelism at once, with dropout drawn
    from layout-invariant masks (model.dropout_rng; tests/test_dropout_invariance.py tests the masks, and every
    layout for 20 steps under `-m slow`). Each layout on its own, without dropout, in-process, is
    tests/test_data_parallel.py's."""
    layouts = {"p1": (1, 1, []), "p2_dp2_sequence_parallel": (4, 2, ["--parallel.sequence_parallel=true"])}
    losses, norms, val_losses = {}, {}, {}
    for name, (world, tp, extra) in layouts.items():
        torchrun("pretrain.py", world, tiny_args(data_dir, tmp_path / name, tp, 10, *DROPOUT, *extra))
        losses[name] = train_losses(tmp_path / name)
        norms[name] = {r["step"]: r["grad_norm"] for r in metrics(tmp_path / name) if "grad_norm" in r}
        val_losses[name] = {r["step"]: r["val_loss"] for r in metrics(tmp_path / name) if "val_loss" in r}
    assert sorted(losses["p1"]) == list(range(1, 11)) and sorted(norms["p1"]) == list(range(1, 11))
    for name, run in losses.items():
        for step, loss in losses["p1"].items():
            # float32: the layouts sum the same products in other orders (TP matmul splits, DP means); the
            # dropout masks are identical
            assert run[step] == pytest.approx(loss, rel=1e-4), f"{name} step {step}"
            # the logged norm counts each parameter once: a DP sum instead of a mean, or a replicated
            # parameter counted per rank, moves it by far more than float noise
            assert norms[name][step] == pytest.approx(norms["p1"][step], rel=1e-4), f"{name} grad_norm step {step}"
        # the validation windows are the same at every data-parallel size (a token mean over all of them)
        assert sorted(val_losses[name]) == [0, 5, 10]
        for step, val_loss in val_losses["p1"].items():
            assert val_losses[name][step] == pytest.approx(val_loss, rel=1e-4), f"{name} val_loss step {step}"


def test_exact_resume_falls_back_past_a_corrupt_checkpoint(reference_run, shared_data, tmp_path):
    """The reference run (p = 2, 6 steps, tests/tiny_run.py) with its newest checkpoint damaged resumes from the
    one before and trains steps 4-6 again bit for bit."""
    first, records = train_losses(reference_run.run), metrics(reference_run.run)
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(records[-1]) and "val_loss" in records[-1]
    assert records[-1]["val_loss"] < records[0]["val_loss"]  # step 0: the untrained model's validation loss
    assert (reference_run.run / "loss.png").stat().st_size > 0 and (reference_run.run / "config.yaml").exists()
    assert [p.name for p in list_checkpoints(reference_run.run / "checkpoints")] == ["step_0000003", "step_0000006"]

    run = copy_run(reference_run.run, tmp_path / "run")
    shard = run / "checkpoints" / "step_0000006" / "model_tp01.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = torchrun("pretrain.py", 2, reference_args(shared_data, run, 6, "--resume"))
    assert "model_tp01.safetensors" in result.stderr  # the warning names the corrupt file
    assert [r["step"] for r in metrics(run)] == list(range(7))  # steps 4-6 logged again, once each
    resumed = train_losses(run)
    for step in (4, 5, 6):  # bit-identical on CPU: same data, weights, optimizer state and RNG
        assert resumed[step] == first[step], f"step {step}: {resumed[step]!r} != {first[step]!r}"


def _stop_with(sig: signal.Signals, run: Path, args: list[str]) -> tuple[int, subprocess.CompletedProcess]:
    """Launch pretrain.py, send `sig` to torchrun's process group once step 3 is logged (as a scheduler, or a
    person at a terminal, does), and return the step of the one checkpoint written and the finished launch."""
    command = torchrun_command("pretrain.py", 2, args)
    proc = subprocess.Popen(command, cwd=ROOT, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (run / "metrics.jsonl").exists() or max(train_losses(run), default=0) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.5)
        os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    saved = list_checkpoints(run / "checkpoints")
    assert len(saved) == 1, err[-3000:]
    return int(saved[0].name.split("_")[1]), subprocess.CompletedProcess(command, proc.returncode, out, err)


def test_sigterm_and_ctrl_c_checkpoint_the_step_reached_and_resume_is_exact(data_dir, tmp_path):
    """SIGTERM (a scheduler) and SIGINT (Ctrl-C at a terminal) alike: one line, no traceback, a checkpoint at the
    step every rank reached. The SIGTERM run resumed is bit-equal to a run never interrupted (a constant schedule:
    the learning rate does not depend on max_steps), one metrics row per step. (Resuming reads the checkpoint the
    same way whichever signal wrote it: one resume tests it.)"""
    constant = ["--checkpoint.interval=1000", "--schedule.decay=constant"]
    stopped_at = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        run = tmp_path / sig.name
        stopped_at[sig], stopped = _stop_with(sig, run, tiny_args(data_dir, run, 2, 500, *constant))
        assert 3 <= stopped_at[sig] < 500
        assert f"finished at step {stopped_at[sig]}" in stopped.stdout
        assert f"(stopped by {sig.name}; resume with --resume)" in stopped.stdout
        assert "KeyboardInterrupt" not in stopped.stderr  # no worker traceback
        assert stopped.returncode == 1  # the workers exit 0; torchrun, signalled itself, exits 1 (failure-modes.md)
    run, end = tmp_path / "SIGTERM", stopped_at[signal.SIGTERM] + 2
    torchrun("pretrain.py", 2, tiny_args(data_dir, run, 2, end, *constant, "--resume"))
    torchrun("pretrain.py", 2, tiny_args(data_dir, tmp_path / "whole", 2, end, *constant))
    steps = [r["step"] for r in metrics(run) if "loss" in r]
    assert steps == list(range(1, end + 1))  # one row per step: rows logged past the checkpoint are replaced
    assert train_losses(run) == train_losses(tmp_path / "whole")  # bit-equal, every step


@pytest.mark.slow  # CI keeps two local agents through tests/test_slurm.py
def test_two_agent_multinode_rendezvous_matches_one_agent(data_dir, tmp_path):
    torchrun("pretrain.py", 2, tiny_args(data_dir, tmp_path / "single", 2, 4))
    port = free_port()
    agent = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "mn"]
    args = tiny_args(data_dir, tmp_path / "multi", 2, 4)
    agents = [subprocess.Popen(torchrun_command("pretrain.py", 1, args, agent), cwd=ROOT, env=environment(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outputs = [a.communicate(timeout=300) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert all(a.returncode == 0 for a in agents), outputs[0][1][-3000:] + outputs[1][1][-3000:]
    single, multi = train_losses(tmp_path / "single"), train_losses(tmp_path / "multi")
    assert sorted(multi) == [1, 2, 3, 4]
    for step, loss in single.items():
        assert multi[step] == pytest.approx(loss, rel=1e-6)
