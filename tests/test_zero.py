"""ZeRO-1 (parallel.zero_stage: 1): the AdamW state is sharded across the data-parallel ranks, at most 0.55x of
the unsharded bytes per rank at dp = 2; its checkpoints hold the same files as an unsharded run's, resume
bit-exactly, and reshard to and from another (p, dp) with the losses of the run that never stopped."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist

from parallel_attention.checkpointing.tensor_io import read_safetensors
from parallel_attention.training import optimizer_state_bytes
from parallel_attention.training.trainer import checkpoint, resume_run
from test_data_parallel import build_run, data_dir, overrides  # noqa: F401  (data_dir is a fixture)
from zero_runs import check_resumes_and_reshards, run_checkpoint_scenario, train_steps


def _zero_checkpoint_worker(data_dir, tmp) -> dict:
    zero0, zero1 = ["--parallel.zero_stage=0"], ["--parallel.zero_stage=1"]
    out = {}
    run = build_run(overrides(data_dir, tmp / "a", 1, *zero1))  # p1 dp2, ZeRO-1
    out["a"] = train_steps(run, 2)
    checkpoint(run)
    out["a"] += train_steps(run, 2)
    out["bytes_zero1"] = optimizer_state_bytes(run.optimizer)
    run = build_run(overrides(data_dir, tmp / "zero0", 1, *zero0))  # the same at zero_stage 0, for its files
    train_steps(run, 2)
    checkpoint(run)
    out["bytes_zero0"] = optimizer_state_bytes(run.optimizer)
    out["numel"] = [p.numel() for p in run.model.parameters()]
    run = build_run(overrides(data_dir, tmp / "a", 1, *zero1))  # exact resume at the same layout
    resume_run(run, "auto")
    out["a_resumed"] = train_steps(run, 2)
    out["bytes_resumed"] = optimizer_state_bytes(run.optimizer)  # loaded from the full state: still a shard
    if dist.get_rank() == 0:
        shutil.copytree(tmp / "a" / "checkpoints" / "step_0000002", tmp / "c" / "checkpoints" / "step_0000002")
    dist.barrier()
    run = build_run(overrides(data_dir, tmp / "c", 2))  # p2 dp1 from the ZeRO checkpoint: resharded
    resume_run(run, "auto")
    out["c"] = train_steps(run, 1)
    checkpoint(run)  # step 3, at p = 2
    out["c"] += train_steps(run, 1)
    run = build_run(overrides(data_dir, tmp / "d", 1, *zero1))  # back to p1 dp2 with ZeRO-1: resharded
    resume_run(run, str(tmp / "c" / "checkpoints" / "step_0000003"))
    out["d"] = train_steps(run, 1)
    return out


def _parsed(meta: dict) -> dict:
    return {k: json.loads(v) for k, v in meta.items()}


@pytest.fixture(scope="module")
def zero_runs(data_dir, tmp_path_factory):
    """The scenario above on two ranks, once for the tests below: (per-rank results, its directory)."""
    return run_checkpoint_scenario(_zero_checkpoint_worker, data_dir, tmp_path_factory, "zero")


def test_optimizer_state_bytes_per_rank_at_dp2(zero_runs):
    ranks, _ = zero_runs
    numel = ranks[0]["numel"]
    # AdamW: exp_avg and exp_avg_sq in float32 per element, and a float32 step per parameter
    assert all(r["bytes_zero0"] == 8 * sum(numel) + 4 * len(numel) for r in ranks)
    assert sum(r["bytes_zero1"] for r in ranks) == ranks[0]["bytes_zero0"]  # a partition: every tensor once
    assert all(r["bytes_resumed"] == r["bytes_zero1"] for r in ranks)
    assert max(r["bytes_zero1"] for r in ranks) <= 0.55 * ranks[0]["bytes_zero0"], [r["bytes_zero1"] for r in ranks]


def test_zero_checkpoints_resume_exactly_and_reshard(zero_runs):
    ranks, tmp_path = zero_runs
    got = check_resumes_and_reshards(ranks, ("a", "a_resumed", "c", "d"))
    # resharded runs sum the same products in another order (float32)
    assert got["c"] == pytest.approx(got["a"][2:], rel=1e-5)
    # consolidated on dp rank 0, the ZeRO-1 optimizer file is the unsharded run's, tensor for tensor
    sharded, sharded_meta = read_safetensors(tmp_path / "a" / "checkpoints" / "step_0000002" / "optim_tp00.safetensors")
    plain, plain_meta = read_safetensors(tmp_path / "zero0" / "checkpoints" / "step_0000002" / "optim_tp00.safetensors")
    assert sharded.keys() == plain.keys() and _parsed(sharded_meta) == _parsed(plain_meta)  # JSON: key order aside
    assert all(torch.equal(sharded[k], plain[k]) for k in plain)
