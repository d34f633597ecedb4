"""End to end under torchrun: losses independent of the parallel layout, exact resume, fallback past
a corrupt checkpoint, SIGTERM and Ctrl-C, multi-node rendezvous, generation with and without the KV cache."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launch import ROOT, environment, free_port, metrics, torchrun, torchrun_command, train_losses
from parallel_attention.checkpointing import list_checkpoints
from parallel_attention.training import prepare_data

MAX_BYTES, VAL_FRACTION = 300_000, 0.05


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data")
    prepare_data("stdlib", "byte", path, val_fraction=VAL_FRACTION, max_bytes=MAX_BYTES)
    return path


def tiny_args(data_dir: Path, run_dir: Path, tp: int, steps: int, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs" / "gpt_tiny.yaml"), "--model.hidden_size=32", "--model.num_layers=2",
            "--model.max_seq_len=32", "--data.seq_len=32", "--training.global_batch_size=8",
            "--training.micro_batch_size=2", f"--training.max_steps={steps}", "--training.eval_interval=5",
            "--training.eval_batches=1", "--schedule.warmup_steps=2", "--logging.log_interval=1",
            "--logging.progress_bar=false", "--logging.tensorboard=false", f"--data.data_dir={data_dir}",
            f"--data.max_bytes={MAX_BYTES}", f"--data.val_fraction={VAL_FRACTION}",
            f"--parallel.tensor_parallel_size={tp}", f"--logging.run_dir={run_dir}", *extra]


def test_losses_do_not_depend_on_the_parallel_layout(data_dir, tmp_path):
    """pretrain.py end to end: one rank against tensor, data and sequence parallelism at once (each layout on its
    own, in-process, is tests/test_data_parallel.py's; two launches here instead of four keep CI under 15 min)."""
    layouts = {"p1": (1, 1, []), "p2_dp2_sequence_parallel": (4, 2, ["--parallel.sequence_parallel=true"])}
    losses, norms, val_losses = {}, {}, {}
    for name, (world, tp, extra) in layouts.items():
        torchrun("pretrain.py", world, tiny_args(data_dir, tmp_path / name, tp, 10, *extra))
        losses[name] = train_losses(tmp_path / name)
        norms[name] = {r["step"]: r["grad_norm"] for r in metrics(tmp_path / name) if "grad_norm" in r}
        val_losses[name] = {r["step"]: r["val_loss"] for r in metrics(tmp_path / name) if "val_loss" in r}
    assert sorted(losses["p1"]) == list(range(1, 11)) and sorted(norms["p1"]) == list(range(1, 11))
    for name, run in losses.items():
        for step, loss in losses["p1"].items():
            # float32: the layouts sum the same products in other orders (TP matmul splits, DP means)
            assert run[step] == pytest.approx(loss, rel=1e-4), f"{name} step {step}"
            # the logged norm counts each parameter once: a DP sum instead of a mean, or a replicated
            # parameter counted per rank, moves it by far more than float noise
            assert norms[name][step] == pytest.approx(norms["p1"][step], rel=1e-4), f"{name} grad_norm step {step}"
        # the validation windows are the same at every data-parallel size (a token mean over all of them)
        assert sorted(val_losses[name]) == [0, 5, 10]
        for step, val_loss in val_losses["p1"].items():
            assert val_losses[name][step] == pytest.approx(val_loss, rel=1e-4), f"{name} val_loss step {step}"


def test_exact_resume_falls_back_past_a_corrupt_checkpoint(data_dir, tmp_path):
    run = tmp_path / "run"
    torchrun("pretrain.py", 2, tiny_args(data_dir, run, 2, 6, "--checkpoint.interval=3"))
    first = train_losses(run)
    records = metrics(run)
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(records[-1]) and "val_loss" in records[-1]
    assert records[-1]["val_loss"] < records[0]["val_loss"]  # step 0: the untrained model's validation loss
    assert (run / "loss.png").stat().st_size > 0 and (run / "config.yaml").exists()
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_0000003", "step_0000006"]

    shard = run / "checkpoints" / "step_0000006" / "model_tp01.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = torchrun("pretrain.py", 2, tiny_args(data_dir, run, 2, 6, "--checkpoint.interval=3", "--resume"))
    assert "model_tp01.safetensors" in result.stderr  # the warning names the corrupt file
    assert [r["step"] for r in metrics(run)] == list(range(7))  # steps 4-6 logged again, once each
    resumed = train_losses(run)
    for step in (4, 5, 6):  # bit-identical on CPU: same data, weights, optimizer state and RNG
        assert resumed[step] == first[step], f"step {step}: {resumed[step]!r} != {first[step]!r}"

    # generation from that run: greedy tokens with the KV cache equal full recomputation
    outputs = [torchrun("generate.py", 2, ["--checkpoint", str(run), "--prompt", "import os", "--max-new-tokens",
                                           "12", "--temperature", "0", "--print-tokens", *flag]).stdout
               for flag in ([], ["--no-cache"])]
    token_lines = [next(line for line in out.splitlines() if line.startswith("tokens:")) for out in outputs]
    assert token_lines[0] == token_lines[1] and len(token_lines[0].split()) == 1 + len("import os") + 12


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


def test_sigterm_writes_a_checkpoint_and_resume_continues(data_dir, tmp_path):
    run = tmp_path / "run"
    stopped_at, _ = _stop_with(signal.SIGTERM, run, tiny_args(data_dir, run, 2, 500, "--checkpoint.interval=1000"))
    assert 3 <= stopped_at < 500
    torchrun("pretrain.py", 2, tiny_args(data_dir, run, 2, stopped_at + 2, "--checkpoint.interval=1000", "--resume"))
    steps = [r["step"] for r in metrics(run) if "loss" in r]
    assert steps[-2:] == [stopped_at + 1, stopped_at + 2]
    assert steps == sorted(set(steps))  # one row per step, though the stopped run may have logged past its checkpoint


def test_ctrl_c_checkpoints_the_step_reached_and_resume_is_exact(data_dir, tmp_path):
    """SIGINT as SIGTERM: one line, a checkpoint at the step every rank reached, and a resume bit-equal to a run
    never interrupted (a constant schedule: the learning rate does not depend on max_steps)."""
    run, constant = tmp_path / "run", ["--checkpoint.interval=1000", "--schedule.decay=constant"]
    stopped_at, stopped = _stop_with(signal.SIGINT, run, tiny_args(data_dir, run, 2, 500, *constant))
    assert f"finished at step {stopped_at}" in stopped.stdout
    assert "(stopped by SIGINT; resume with --resume)" in stopped.stdout
    assert "KeyboardInterrupt" not in stopped.stderr  # no worker traceback
    assert stopped.returncode == 1  # the workers exit 0; torchrun, signalled itself, exits 1 (docs/failure-modes.md)
    torchrun("pretrain.py", 2, tiny_args(data_dir, run, 2, stopped_at + 2, *constant, "--resume"))
    torchrun("pretrain.py", 2, tiny_args(data_dir, tmp_path / "whole", 2, stopped_at + 2, *constant))
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
