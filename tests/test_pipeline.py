"""Pipeline parallelism end to end: every schedule, at pp 2 and 4, inside TP + SP, CP and DP, with uneven stages and
tied embeddings, gives the single process's losses, gradient norms and validation losses; a checkpoint of any layout
resumes at any other, into and out of a pipeline, with the same losses. (The schedules' and the split's own
properties: tests/test_pipeline_schedules.py; the timeline's picture: tests/test_pipeline_timeline.py.)"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

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
    # the collective guard records and cross-checks ChunkReducer's all-reduces from inside the backward
    "pp2_dp2_1f1b_guarded": (4, ["--parallel.pipeline_parallel_size=2", "--parallel.debug_collectives=true"]),
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


PP2 = "--parallel.pipeline_parallel_size=2"
INTERLEAVED = (PP2, "--parallel.pipeline_schedule=interleaved_1f1b", "--parallel.virtual_pipeline_stages=2")
HOPS = [  # (name, world, tp, layout arguments, the hop's checkpoint to resume from (None: start), its last step)
    ("tp2", 2, 2, (), None, 1),
    ("pp2", 2, 1, (PP2,), "tp2", 2),  # tp 2 -> pp 2
    ("pp2_tp2", 4, 2, (PP2,), "pp2", 3),  # pp 2 -> pp 2 x tp 2
    ("pp2_other_split", 2, 1, (PP2, "--parallel.pipeline_layers=[3,1]"), "pp2_tp2", 4),  # and back to tp 1
    ("interleaved", 2, 1, INTERLEAVED, "pp2", 3),  # 1f1b -> interleaved (v 2)
    ("pp1", 1, 1, (), "interleaved", 4),  # interleaved -> one process
]


def _hop(shared_data, root: Path, name: str) -> tuple[Path, str]:
    """One hop: the named layout resumes the previous hop's last checkpoint (a copy) and trains to its step."""
    _, world, tp, layout, source, step = next(h for h in HOPS if h[0] == name)
    run = root / name
    if source is not None:
        previous = next(h for h in HOPS if h[0] == source)
        step_dir = f"step_{previous[5]:07d}"
        shutil.copytree(root / source / "checkpoints" / step_dir, run / "checkpoints" / step_dir)
    return run, torchrun("pretrain.py", world, tiny_args(shared_data, run, tp, step, *MODEL, "--checkpoint.interval=1",
                                                          *layout)).stderr


def test_a_checkpoint_of_any_layout_resumes_at_any_other_with_the_single_process_losses(reference, shared_data,
                                                                                        tmp_path):
    """A chain of one-step hops, each resuming the last one's checkpoint at another layout, into and out of a
    pipeline (tp 2 -> pp 2 -> pp 2 x tp 2 -> pp 2 with another split; pp 2 -> interleaved -> one process), then
    the offline tool's checkpoints at pp 1 and at pp 2: each step gives the uninterrupted single process's loss and
    gradient norm, and each resume that changed the layout says so in its start line."""
    said = {}
    for name, *_ in HOPS:
        run, said[name] = _hop(shared_data, tmp_path, name)
        step = next(h[5] for h in HOPS if h[0] == name)
        _assert_same(_records(run), reference[1], f"resumed at {name}", (step,))
    assert "layout changed: written at tp 2, 2 ranks, resharded to tp 1 x pp 2 (layers 0-1 | 2-3), 2 ranks" in \
        said["pp2"], said["pp2"]
    assert "resharded to tp 1 x pp 2 (layers 0, 2 | 1, 3), 2 ranks" in said["interleaved"]
    step2 = tmp_path / "pp2" / "checkpoints" / "step_0000002"
    names = sorted(p.name for p in step2.iterdir())
    assert "model_tp00_pp01.safetensors" in names and "optim_tp00_pp00.safetensors" in names
    canonical = read_canonical_checkpoint(step2)[1]  # every stage's file joined: what export and generate read
    assert {f"layers.{i}.input_norm.weight" for i in range(4)} <= set(canonical)
    said = run_command([sys.executable, str(ROOT / "scripts" / "generate.py"), "--checkpoint", str(step2), "--prompt",
                        "import", "--max-new-tokens", "2"], check=True, env=environment(), timeout=120).stderr
    size = sum(t.numel() for t in canonical.values())  # every stage's, the tied table once
    assert f"({size / 1e6:.2f}M parameters, trained at tensor_parallel_size=1 x pipeline_parallel_size=2), " \
           "generating at tensor_parallel_size=1, one pipeline stage" in said, said

    # offline: pp 2 x tp 2's step 3 at one stage (resumed at pp 2, zero bubble), tp 2's step 1 at pp 2 split [1, 3]
    reshard_checkpoint(tmp_path / "pp2_tp2" / "checkpoints" / "step_0000003", tmp_path / "from_pp1" / "checkpoints", 1)
    assert canonical.keys() == read_canonical_checkpoint(tmp_path / "from_pp1" / "checkpoints" / "step_0000003")[1].keys()
    torchrun("pretrain.py", 2, tiny_args(shared_data, tmp_path / "from_pp1", 1, STEPS, *MODEL, PP2,
                                         "--parallel.pipeline_schedule=zero_bubble"))
    _assert_same(_records(tmp_path / "from_pp1"), reference[1], "resharded to pp 1, resumed at pp 2", (4,))
    out = tmp_path / "tool_pp2"
    run_command([sys.executable, str(ROOT / "scripts" / "reshard_checkpoint.py"), "--in",
                 str(tmp_path / "tp2" / "checkpoints" / "step_0000001"), "--out", str(out), "--tp", "1", "--pp", "2",
                 "--pipeline-layers", "1,3"], check=True, env=environment(), timeout=120)
    parallel = yaml.safe_load((out / "config.yaml").read_text())["parallel"]
    assert (parallel["pipeline_parallel_size"], parallel["pipeline_layers"], parallel["tensor_parallel_size"]) == \
        (2, [1, 3], 1)
    torchrun("pretrain.py", 2, ["--config", str(out / "config.yaml"), "--training.max_steps=2"])  # as it says
    _assert_same(_records(out), reference[1], "the tool's pp 2 files, resumed by its config.yaml", (2,))


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
