"""The divergence guard: non-finite steps stop the run (fp16 overflows aside, up to a limit), are logged
as JSON null, never reach a checkpoint, and pruning keeps the newest finite checkpoint. metrics.jsonl
keeps one row per step across restarts."""

from __future__ import annotations

import json
import math
import re

import pytest
from torch import nn

from launch import torchrun
from parallel_attention.checkpointing import list_checkpoints
from parallel_attention.checkpointing.checkpoint import save_checkpoint
from parallel_attention.training.guards.divergence import DivergenceError, DivergenceGuard
from parallel_attention.training.loss_scaler import DynamicLossScaler
from parallel_attention.training.metrics import MetricsLogger, json_line, keep_history, read_metrics
from test_pretrain import data_dir, tiny_args  # noqa: F401  (data_dir is a fixture)

NAN, INF = float("nan"), float("inf")


def test_float32_stops_at_the_first_non_finite_loss_or_norm():
    guard = DivergenceGuard(DynamicLossScaler(enabled=False), max_skipped_steps=10, dtype="float32")
    assert guard.update(1, 2.5, 1.0) and guard.stop_reason is None
    guard.raise_if_stopped()
    assert not guard.update(2, 2.5, INF) and guard.skipped_steps == 1
    with pytest.raises(DivergenceError, match=r"step 2: non-finite grad_norm \(inf\) in float32.*optimizer.lr"):
        guard.raise_if_stopped()
    guard = DivergenceGuard(DynamicLossScaler(enabled=False), max_skipped_steps=10, dtype="bfloat16")
    assert not guard.update(7, NAN, NAN)
    assert guard.stop_reason == "step 7: non-finite loss (nan) and grad_norm (nan) in bfloat16"


def test_float16_tolerates_overflows_up_to_the_limit():
    scaler = DynamicLossScaler(enabled=True, initial_scale=2.0**16)
    guard = DivergenceGuard(scaler, max_skipped_steps=2, dtype="float16")
    assert not guard.update(1, 3.0, INF) and not guard.update(2, 3.0, NAN)  # two overflows in a row: allowed
    assert guard.stop_reason is None and scaler.scale == 2.0**14 and guard.skipped_steps == 2
    assert guard.update(3, 3.0, 1.0) and guard.consecutive == 0  # a good step resets the streak, not the count
    assert [guard.update(s, 3.0, INF) for s in (4, 5)] == [False, False] and guard.stop_reason is None
    assert not guard.update(6, 3.0, INF) and guard.skipped_steps == 5
    with pytest.raises(DivergenceError, match=r"step 6: non-finite grad_norm \(inf\) for 3 consecutive fp16 steps "
                                              r"\(training.max_skipped_steps=2; loss scale now 2048\)"):
        guard.raise_if_stopped()
    guard = DivergenceGuard(DynamicLossScaler(enabled=True), max_skipped_steps=10, dtype="float16")
    assert not guard.update(1, NAN, INF) and "non-finite loss (nan)" in guard.stop_reason  # not an overflow


def test_metrics_are_strict_json_with_null_for_non_finite_values(tmp_path):
    assert json.loads(json_line({"step": 3, "loss": NAN, "grad_norm": INF, "lr": 1.0})) == \
        {"step": 3, "loss": None, "grad_norm": None, "lr": 1.0}
    logger = MetricsLogger(tmp_path, max_steps=2, start_step=0, progress_bar=False, tensorboard=False)
    logger.log({"step": 1, "loss": NAN, "lr": 1e-3, "grad_norm": -INF, "tokens_per_s": 10.0, "skipped_steps": 1})
    logger.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text and read_metrics(tmp_path / "metrics.jsonl")[0]["loss"] is None


def test_a_run_opened_at_step_n_keeps_one_row_per_step_up_to_n(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "val_loss": 5.0}] + [{"step": s, "loss": float(s)} for s in (1, 2, 3, 4, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')  # a torn last line
    keep_history(path, 3)  # resumed from the checkpoint of step 3: steps 4, 5 are about to be logged again
    assert read_metrics(path) == [{"step": 0, "val_loss": 5.0}] + [{"step": s, "loss": float(s)} for s in (1, 2, 3)]
    keep_history(path, 0)  # a fresh run logs step 0 again
    assert read_metrics(path) == []


def _save(root, step: int, finite: bool) -> None:
    save_checkpoint(root, step, nn.Linear(2, 2), None, config={}, extra={"finite": finite}, keep_last=2)


def test_pruning_never_removes_the_newest_finite_checkpoint(tmp_path):
    for step, finite in [(1, True), (2, True), (3, False), (4, False), (5, False)]:
        _save(tmp_path, step, finite)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000002", "step_0000004", "step_0000005"]
    _save(tmp_path, 6, True)  # a finite one among the newest two again: the older finite one may go
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000005", "step_0000006"]


def test_a_diverging_run_stops_before_checkpointing(data_dir, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    args = tiny_args(data_dir, run, 2, 30, "--optimizer.lr=1000", "--checkpoint.interval=1",
                     "--checkpoint.keep_last=1")
    result = torchrun("pretrain.py", 2, args, check=False)
    assert result.returncode != 0 and "finished at step" not in result.stdout
    found = re.search(r"DivergenceError: step (\d+): non-finite (loss|grad_norm)", result.stderr)
    assert found, result.stderr[-3000:]
    diverged = int(found.group(1))
    # every finite step was checkpointed (interval 1) and kept only the newest: the one before divergence
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == [f"step_{diverged - 1:07d}"]
    with open(run / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]  # strict JSON: a bare NaN would not parse as null
    assert [r["step"] for r in records] == list(range(diverged + 1))
    assert all("skipped_steps" in r for r in records[1:]) and records[-1]["skipped_steps"] == 1
    assert records[-1]["loss"] is None or records[-1]["grad_norm"] is None
    assert all(math.isfinite(r["loss"]) for r in records[1:-1])

