"""What a run says at start: a fresh start says it starts at step 0 and why; a finished run launched again says
there is nothing to do, exits 0, and trains, evaluates and rewrites nothing."""

from __future__ import annotations

from pathlib import Path

from launch import torchrun
from test_pretrain import data_dir, tiny_args  # noqa: F401 (data_dir is a fixture)


def _files(run: Path) -> dict[str, tuple[int, bytes]]:
    """Every file of the run but the lock and lease (the next launch takes them), with its mtime and bytes."""
    return {str(p.relative_to(run)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(run.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


def test_a_fresh_start_says_so_and_a_finished_run_has_nothing_to_do(data_dir, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    fresh = torchrun("pretrain.py", 1, tiny_args(data_dir, run, 1, 2))
    assert f"starting at step 0 (no checkpoint in {run / 'checkpoints'})" in fresh.stderr
    before = _files(run)
    assert {"metrics.jsonl", "loss.png", "config.yaml"} <= set(before)
    again = torchrun("pretrain.py", 1, tiny_args(data_dir, run, 1, 2))  # exits 0: torchrun() checks
    assert (f"nothing to do: {run} is at step 2 = training.max_steps; raise it to train on, or use another "
            "logging.run_dir") in again.stderr
    assert "finished at step" not in again.stdout and "resumed from" not in again.stderr
    assert _files(run) == before  # no metrics row, plot, config, tokenizer or checkpoint written again
