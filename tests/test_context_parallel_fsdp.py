"""ZeRO-3 (FSDP2) under context parallelism, resume across cp, and the run summary / MFU under CP.

- parallel.zero_stage: 3 at cp2 x dp1 (world 2) and cp2 x dp2 (world 4): FSDP2 shards over the dp x cp ranks, the
  ones that replicate each parameter, so the losses and clipped gradient norms equal one process's (float32,
  1e-5 relative: the layouts only reorder sums), one reduce-scatter per FSDP2 group and step, and parameters +
  gradients + AdamW state per rank at most 0.55x one process's at dp x cp = 2.
- checkpoints do not depend on cp: a run saved at cp2 (ZeRO-3) resumes at cp1 (dp2, ZeRO-1), and one saved at
  cp1 resumes at cp2 (ZeRO-3), the losses continuing within 1e-5 (measured <= 1e-7).
- the summary's layout line names cp and its kind; a step's TFLOP/s counts the full sequence's attention over
  every device of dp x cp x tp.
"""

from __future__ import annotations

import contextlib
import io
import shutil

import pytest
import torch.distributed as dist

from distributed import run_distributed
from parallel_attention.tensor_parallel import parallel_state as ps
from parallel_attention.training.flops import flops_per_token, step_rates
from parallel_attention.training.fsdp import mesh_of
from parallel_attention.training.trainer import _train_built, checkpoint, resume_run
from test_data_parallel import build_run, data_dir, overrides  # noqa: F401  (data_dir is a fixture)
from zero_runs import train_steps
from test_zero3 import ZERO1, ZERO3, _compare, _layouts_worker

CP2, RING, A2A = "--parallel.context_parallel_size=2", "--parallel.context_parallel_kind=ring", \
    "--parallel.context_parallel_kind=all_to_all"


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("cp_fsdp_p1")
    (ranks,) = run_distributed(_layouts_worker, 1, 1, [("p1", overrides(data_dir, tmp / "p1", 1))])
    return ranks["p1"]


def _check_sharded(per_rank: list[dict], reference: dict, ratio: float) -> None:
    _compare(per_rank, reference)
    for name, got in per_rank[0].items():
        assert all(r[name]["sharded"] for r in per_rank), name
        # one reduce-scatter per FSDP2 group (each layer, the root) and step, none on accumulation micro-batches
        assert got["reduce_scatters"] == [got["groups"]] * len(got["losses"]), (name, got["reduce_scatters"])
        assert max(r[name]["bytes"] for r in per_rank) <= ratio * reference["bytes"], name


def test_zero3_at_cp2_shards_over_the_context_ranks_and_trains_like_one_process(data_dir, tmp_path, reference):
    world2 = run_distributed(_layouts_worker, 2, 1, [
        ("cp2_ring_zero3", overrides(data_dir, tmp_path / "a", 1, ZERO3, CP2, RING)),
        ("cp2_a2a_zero3", overrides(data_dir, tmp_path / "b", 1, ZERO3, CP2, A2A))])
    # dp = 1: without the cp ranks in FSDP2's mesh nothing would be sharded (0.55x) and no reduce-scatter run
    _check_sharded(world2, reference, 0.55)


def test_zero3_at_cp2_dp2_trains_like_one_process(data_dir, tmp_path, reference):
    world4 = run_distributed(_layouts_worker, 4, 1, [
        ("cp2_dp2_ring_zero3", overrides(data_dir, tmp_path / "a", 1, ZERO3, CP2, RING))])
    _check_sharded(world4, reference, 0.3)  # dp x cp = 4: about a quarter


@pytest.mark.slow
def test_zero3_at_tp2_cp2_trains_like_one_process(data_dir, tmp_path, reference):
    world4 = run_distributed(_layouts_worker, 4, 2, [
        ("tp2_cp2_a2a_zero3", overrides(data_dir, tmp_path / "a", 2, ZERO3, CP2, A2A)),
        ("tp2_cp2_sp_ring_zero3", overrides(data_dir, tmp_path / "b", 2, ZERO3, CP2, RING,
                                            "--parallel.sequence_parallel=true"))])
    _compare(world4, reference)


def _copy_checkpoint(tmp, source: str, target: str, step: int) -> None:
    name = f"step_{step:07d}"
    if dist.get_rank() == 0:
        shutil.copytree(tmp / source / "checkpoints" / name, tmp / target / "checkpoints" / name)
    dist.barrier()


def _resume_worker(data_dir, tmp) -> dict:
    """cp2 (ZeRO-3) 4 steps, saved at 2, resumed at cp1 dp2 (ZeRO-1); cp1 dp2 4 steps, saved at 2, resumed at
    cp2 (ZeRO-3); plus the summary, and a step's rates, of a cp2 run."""
    out = {}
    for name, stage, layout, other in (("cp2", ZERO3, [CP2, RING], []), ("cp1", ZERO1, [], [ZERO3, CP2, A2A])):
        run = build_run(overrides(data_dir, tmp / name, 1, stage, *layout))
        out[name] = train_steps(run, 2)
        checkpoint(run)
        out[name] += train_steps(run, 2)
        _copy_checkpoint(tmp, name, f"{name}_resumed", 2)
        run = build_run(overrides(data_dir, tmp / f"{name}_resumed", 1, *other))
        resume_run(run, "auto")
        out[f"{name}_resumed"] = train_steps(run, 2)
    run = build_run(overrides(data_dir, tmp / "summary", 1, CP2, "--training.max_steps=1"))  # all_to_all: the default
    rates = step_rates(run.cfg, run.device, run.tokens_per_step, seconds=2.0)
    out["tflops"] = (rates["tflops"], flops_per_token(run.cfg.model, run.cfg.data.seq_len) * run.tokens_per_step
                     / 2.0 / dist.get_world_size() / 1e12, run.tokens_per_step)
    with contextlib.redirect_stderr(io.StringIO()) as err:
        _train_built(run.cfg, run, "none")
    out["summary"] = err.getvalue()
    job, other = mesh_of(ps.get_data_context_parallel_group()), mesh_of(None)  # the job's dp x cp mesh; the world's
    out["meshes"] = (job is ps.get_data_context_parallel_mesh(), job.mesh_dim_names, job.mesh.tolist(),
                     other is job, other.mesh.tolist())
    return out


def test_a_checkpoint_resumes_at_another_cp_and_the_summary_counts_cp(data_dir, tmp_path):
    ranks = run_distributed(_resume_worker, 2, 1, data_dir, tmp_path)
    got = ranks[0]
    assert all(r["cp2"] == got["cp2"] and r["cp1_resumed"] == got["cp1_resumed"] for r in ranks)
    # the same global batches at every layout: the four runs share one loss curve
    assert got["cp1"] == pytest.approx(got["cp2"], rel=1e-5)
    assert got["cp2_resumed"] == pytest.approx(got["cp2"][2:], rel=1e-5)
    assert got["cp1_resumed"] == pytest.approx(got["cp1"][2:], rel=1e-5)
    tflops, expected, tokens = got["tflops"]
    # the whole job's tokens (global batch x the full sequence), over every device of dp x cp x tp
    assert tokens == 8 * 16 and tflops == pytest.approx(expected, rel=1e-12)
    assert "layout       world 2 = tensor parallel 1 x context parallel 2 (all_to_all) x data parallel 1" \
        in got["summary"], got["summary"]
    assert got["meshes"] == (True, ("dp_cp",), [0, 1], False, [0, 1])  # FSDP2's mesh at cp2: over dp x cp
