"""Pipeline parallelism end to end: every schedule, at pp 2 and 4, inside TP + SP, CP and DP, with uneven stages and
tied embeddings, gives the single process's losses, gradient norms and validation losses; a pp 2 checkpoint resumes
at pp 1 with the same losses. (The schedules' and the split's own properties: tests/test_pipeline_schedules.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launch import ROOT, environment, metrics, run_command, torchrun
from parallel_attention.checkpointing import read_canonical_checkpoint, reshard_checkpoint
from tiny_run import DROPOUT, tiny_args

STEPS = 4
# 4 layers (pp 4 needs one per stage), tied embeddings (a copy on the last stage), rotary and grouped k/v heads,
# dropout from layout-invariant masks (the same masks at every layout), 8 sequences of 32 tokens a step
MODEL = ("--model.num_layers=4", "--model.tie_embeddings=true", "--model.num_kv_heads=2",
         "--model.position_embedding=rotary", "--training.eval_batches=2", "--training.eval_interval=2",
         "--checkpoint.interval=2", *DROPOUT)

LAYOUTS = {  # name: (world, extra arguments)
    "pp2_zero_bubble_uneven": (2, ["--parallel.pipeline_parallel_size=2", "--parallel.pipeline_schedule=zero_bubble",
                                   "--parallel.pipeline_layers=[1,3]"]),
    "pp2_tp2_sp_1f1b": (4, ["--parallel.pipeline_parallel_size=2", "--parallel.tensor_parallel_size=2",
                            "--parallel.sequence_parallel=true"]),
    "pp4_gpipe": (4, ["--parallel.pipeline_parallel_size=4", "--parallel.pipeline_schedule=gpipe"]),
    "pp2_cp2_ring_interleaved": (4, ["--parallel.pipeline_parallel_size=2", "--parallel.context_parallel_size=2",
                                     "--parallel.context_parallel_kind=ring",
                                     "--parallel.pipeline_schedule=interleaved_1f1b",
                                     "--parallel.virtual_pipeline_stages=2"]),
    "pp2_dp2_zero3_1f1b": (4, ["--parallel.pipeline_parallel_size=2", "--parallel.zero_stage=3"]),
    # ChunkReducer: each chunk's buckets average during its last backward (two chunks), or after zero bubble's W
    "pp2_dp2_interleaved": (4, ["--parallel.pipeline_parallel_size=2", "--parallel.pipeline_schedule=interleaved_1f1b",
                                "--parallel.virtual_pipeline_stages=2"]),
    "pp2_dp2_zero_bubble_zero0": (4, ["--parallel.pipeline_parallel_size=2", "--parallel.pipeline_schedule=zero_bubble",
                                      "--parallel.zero_stage=0"]),
}


def _records(run: Path) -> tuple[dict, dict, dict]:
    rows = metrics(run)
    return ({r["step"]: r["loss"] for r in rows if "loss" in r}, {r["step"]: r["grad_norm"] for r in rows if
                                                                  "grad_norm" in r},
            {r["step"]: r["val_loss"] for r in rows if "val_loss" in r})


def _assert_same(got: tuple, want: tuple, name: str, steps) -> None:
    for what, g, w in zip(("loss", "grad_norm", "val_loss"), got, want):
        for step in steps:
            if step in w:  # float32: the layouts sum the same products in other orders
                assert g[step] == pytest.approx(w[step], rel=1e-5, abs=1e-6), f"{name} {what} step {step}"


@pytest.fixture(scope="module")
def reference(shared_data, tmp_path_factory) -> tuple[Path, tuple]:
    run = tmp_path_factory.mktemp("pp_reference") / "run"
    torchrun("pretrain.py", 1, tiny_args(shared_data, run, 1, STEPS, *MODEL))
    return run, _records(run)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_schedule_and_layout_gives_the_single_process_numbers(name, reference, shared_data, tmp_path):
    world, extra = LAYOUTS[name]
    run = tmp_path / name
    torchrun("pretrain.py", world, tiny_args(shared_data, run, 1, STEPS, *MODEL, *extra))
    got = _records(run)
    assert sorted(got[0]) == list(range(1, STEPS + 1)) and sorted(got[2]) == [0, 2, 4]
    _assert_same(got, reference[1], name, range(STEPS + 1))
    rows = [r for r in metrics(run) if "loss" in r]
    assert all(0.0 <= r["pipeline_bubble"] < 1.0 for r in rows), rows
    if name == "pp2_zero_bubble_uneven":  # the step's picture, from the run itself
        result = run_command([sys.executable, str(ROOT / "scripts" / "pipeline_timeline.py"), str(run), "--step",
                              "3"], capture_output=True, text=True, timeout=120, check=True)
        assert "2 stages, measured bubble" in result.stdout
        trace = json.loads((run / "pipeline_timeline" / "step_3.trace.json").read_text())
        labels = {(e["tid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"}
        assert {(s, f"{k}{i}") for s in (0, 1) for k in "FBW" for i in range(2)} <= labels, labels
        assert (run / "pipeline_timeline" / "step_3.png").stat().st_size > 0


def test_a_pipeline_checkpoint_resumes_at_another_layout(reference, shared_data, tmp_path):
    """pp 2's step-2 checkpoint (per-stage files, layers named by their global index) resumed by one process:
    resharded through the canonical state dict, steps 3 and 4 give the reference's numbers."""
    run = tmp_path / "pp2"
    world, extra = LAYOUTS["pp2_zero_bubble_uneven"]
    torchrun("pretrain.py", world, tiny_args(shared_data, run, 1, 2, *MODEL, *extra))
    names = sorted(p.name for p in (run / "checkpoints" / "step_0000002").iterdir())
    assert "model_tp00_pp01.safetensors" in names and "optim_tp00_pp00.safetensors" in names
    step2 = run / "checkpoints" / "step_0000002"
    canonical = read_canonical_checkpoint(step2)[1]  # every stage's file joined: what export and generate read
    reshard_checkpoint(step2, tmp_path / "pp1", 1)
    assert canonical.keys() == read_canonical_checkpoint(tmp_path / "pp1" / "step_0000002")[1].keys()
    assert {f"layers.{i}.input_norm.weight" for i in range(4)} <= set(canonical)
    torchrun("pretrain.py", 1, tiny_args(shared_data, run, 1, STEPS, *MODEL))
    _assert_same(_records(run), reference[1], "resumed at pp 1", (3, 4))


DOCUMENTED_CHECK = "torchrun --standalone --nproc-per-node 2 -m parallel_attention.check --pp 2"  # docs/pipeline.md


def test_the_self_check_checks_every_schedule_at_pp_2():
    """docs/pipeline.md's command, as written (this interpreter's torchrun)."""
    result = torchrun_module(DOCUMENTED_CHECK.split()[-4:], 2)
    assert "[ok] pipeline: pp 2, gpipe, 1f1b, interleaved_1f1b, zero_bubble" in result.stdout, result.stdout
    assert result.stdout.rstrip().endswith("check: PASS")


def torchrun_module(args: list[str], nproc: int):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    return run_command(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=300,
                       check=True)
