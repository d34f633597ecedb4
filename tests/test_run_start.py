"""What a run says at start: a fresh start says it starts at step 0 and why; a finished run launched again says
there is nothing to do, exits 0, and trains, evaluates and rewrites nothing."""

from __future__ import annotations

from pathlib import Path

from launch import torchrun
from tiny_run import copy_run, reference_args


def _files(run: Path) -> dict[str, tuple[int, bytes]]:
    """Every file of the run but the lock and lease (the next launch takes them), with its mtime and bytes."""
    return {str(p.relative_to(run)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(run.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


def test_a_fresh_start_says_so_and_a_finished_run_has_nothing_to_do(reference_run, shared_data, tmp_path):
    """The reference run's launch (tests/tiny_run.py) started fresh; a copy of it, finished, launched again."""
    assert f"starting at step 0 (no checkpoint in {reference_run.run / 'checkpoints'})" in reference_run.stderr
    run = copy_run(reference_run.run, tmp_path / "run")
    before = _files(run)
    assert {"metrics.jsonl", "loss.png", "config.yaml"} <= set(before)
    again = torchrun("pretrain.py", 2, reference_args(shared_data, run))  # exits 0: torchrun() checks
    assert (f"nothing to do: {run} is at step 6 = training.max_steps; raise it to train on, or use another "
            "logging.run_dir") in again.stderr
    assert "finished at step" not in again.stdout and "resumed from" not in again.stderr
    assert _files(run) == before  # no metrics row, plot, config, tokenizer, event file or checkpoint written again
