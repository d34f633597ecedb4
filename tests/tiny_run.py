"""The tiny pretraining run of the end-to-end tests, and what several test files share of it.

`tiny_args` are pretrain.py's arguments for a model that trains a step in milliseconds. A launch costs seconds
of start-up (torch imported by torchrun and every rank), so what many files only read is made once per test
session and shared by the xdist workers (`once`): the prepared data (`shared_data`) and one finished run
(`reference_run`: p = 2, 6 steps, checkpoints at steps 3 and 6, k/v heads that p = 4 replicates, TensorBoard
on), with the stderr of the launch that made it. Tests that change a run work on a copy (`copy_run`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from launch import ROOT, torchrun

MAX_BYTES, VAL_FRACTION = 300_000, 0.05
# the reference run's arguments beyond tiny_args: grouped-query attention (2 k/v heads: p = 4 replicates them),
# rotary positions, a checkpoint at steps 3 and 6
REFERENCE_EXTRA = ("--model.num_kv_heads=2", "--model.position_embedding=rotary", "--checkpoint.interval=3")
REFERENCE_TP, REFERENCE_STEPS = 2, 6
# dropout whose masks depend on the global coordinates only, not on the layout (model.dropout_rng)
DROPOUT = ("--model.hidden_dropout=0.1", "--model.attention_dropout=0.1", "--model.dropout_rng=layout_invariant")


def tiny_args(data_dir: Path, run_dir: Path, tp: int, steps: int, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs" / "gpt_tiny.yaml"), "--model.hidden_size=32", "--model.num_layers=2",
            "--model.max_seq_len=32", "--data.seq_len=32", "--training.global_batch_size=8",
            "--training.micro_batch_size=2", f"--training.max_steps={steps}", "--training.eval_interval=5",
            "--training.eval_batches=1", "--schedule.warmup_steps=2", "--logging.log_interval=1",
            "--logging.progress_bar=false", "--logging.tensorboard=false", f"--data.data_dir={data_dir}",
            f"--data.max_bytes={MAX_BYTES}", f"--data.val_fraction={VAL_FRACTION}",
            f"--parallel.tensor_parallel_size={tp}", f"--logging.run_dir={run_dir}", *extra]


def reference_args(data_dir: Path, run_dir: Path, steps: int = REFERENCE_STEPS, *extra: str,
                   tp: int = REFERENCE_TP) -> list[str]:
    """The reference run's arguments (TensorBoard on), for launches that must match it or resume it."""
    args = tiny_args(data_dir, run_dir, tp, steps, *REFERENCE_EXTRA, *extra)
    return [a if a != "--logging.tensorboard=false" else "--logging.tensorboard=true" for a in args]


def session_dir(tmp_path_factory) -> Path:
    """A directory every xdist worker of this session sees (each worker's basetemp is a child of it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once(root: Path, name: str, make) -> Path:
    """root/name, made by make(path) by the first caller of the session; the others wait for it and reuse it."""
    path = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its process dies
        if not (root / f"{name}.done").exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            make(path)
            (root / f"{name}.done").touch()
    return path


def prepare(path: Path) -> None:
    from parallel_attention.training import prepare_data

    prepare_data("stdlib", "byte", path, val_fraction=VAL_FRACTION, max_bytes=MAX_BYTES)


def make_reference(data_dir: Path, path: Path) -> None:
    run = path / "run"
    result = torchrun("pretrain.py", REFERENCE_TP, reference_args(data_dir, run))
    (path / "stdout.txt").write_text(result.stdout, encoding="utf-8")
    (path / "stderr.txt").write_text(result.stderr, encoding="utf-8")


def copy_run(source: Path, target: Path) -> Path:
    """A copy of a finished run to change (its lock and lease left behind, as a new directory has none)."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(".lock", ".lease.json"))
    return target
