"""ZeRO-3 (parallel.zero_stage: 3, torch's FSDP2 over the data-parallel dimension, our tensor parallelism inside):
the losses and clipped gradient norms of dp = 2 and p = 2 x dp = 2 (with and without SP) equal one process's, with
one reduce-scatter per FSDP2 group and step (none on accumulation micro-batches); the audit and the finiteness
guard still fire on the shards; parameters, gradients and AdamW state per rank are at most 0.55x the unsharded
bytes at dp = 2; its checkpoints
hold the files of an unsharded run, resume bit-exactly, and load at zero_stage 1 and at another p."""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
import torch.distributed as dist

import parallel_attention as pa
from distributed import run_distributed
from parallel_attention.checkpointing.tensor_io import read_safetensors
from parallel_attention.training import optimizer_state_bytes
from parallel_attention.training.config.schema import ConfigError
from parallel_attention.tensor_parallel.param_kinds import Sharded, local_shard, parameter_kinds
from parallel_attention.training.guards.divergence import DivergenceError, check_parameters_finite
from parallel_attention.training.guards.rank_checks import ReplicaMismatchError, check_replicas
from parallel_attention.training.sharded_optimizer import parameter_and_gradient_bytes
from parallel_attention.training.trainer import checkpoint, resume_run, train_step
from test_data_parallel import STEPS, build_run, data_dir, overrides  # noqa: F401  (data_dir is a fixture)
from zero_runs import check_resumes_and_reshards, run_checkpoint_scenario, train_steps

ZERO3, ZERO1, ZERO0 = "--parallel.zero_stage=3", "--parallel.zero_stage=1", "--parallel.zero_stage=0"


def _layouts_worker(layouts: list[tuple[str, list[str]]]) -> dict:
    """Each named layout: STEPS clipped steps (losses, norms), then the audit, and the bytes this rank holds."""
    results = {}
    for name, args in layouts:
        run = build_run(args)
        records, reduce_scatters = [], []
        for _ in range(STEPS):
            with _counted("reduce_scatter_single") as calls:
                records.append(train_step(run))
            reduce_scatters.append(len(calls))
        check_replicas(run.model, run.step)  # the audit still runs (and passes) on FSDP2's shards
        params, grads = parameter_and_gradient_bytes(run.model)
        results[name] = {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
                         "bytes": params + grads + optimizer_state_bytes(run.optimizer),
                         "sharded": type(run.model).__name__.startswith("FSDP"), "guards": _guards_fire(run),
                         "reduce_scatters": reduce_scatters, "groups": len(run.model.layers) + 1}
    return results


@contextlib.contextmanager
def _counted(name: str):
    """Record each call of torch.distributed.`name` (FSDP2 looks it up at call time) made inside."""
    real, calls = getattr(dist, name), []

    def counting(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)
    setattr(dist, name, counting)
    try:
        yield calls
    finally:
        setattr(dist, name, real)


def _guards_fire(run) -> list[str]:
    """On FSDP2's shards, the audit names a tensor-parallel replica changed on global rank 1, and the finiteness
    check a NaN there (every rank raises); the run is spoiled afterwards."""
    if pa.get_tensor_model_parallel_world_size() == 1:
        return []
    name, param = next((n, p) for n, (p, kind) in parameter_kinds(run.model).items()  # a norm, say
                       if not isinstance(kind, Sharded) and getattr(kind, "sharded_dim", None) is None)
    messages = []
    for spoil, check, error in ((1.0, lambda: check_replicas(run.model, run.step), ReplicaMismatchError),
                                (float("nan"), lambda: check_parameters_finite(run.model, run.step, run.device),
                                 DivergenceError)):
        if dist.get_rank() == 1:
            with torch.no_grad():
                local_shard(param)[0].add_(spoil)
        with pytest.raises(error) as raised:
            check()
        messages.append(str(raised.value))
    return [name, *messages]


def _compare(per_rank: list[dict], expected: dict) -> None:
    for name, got in per_rank[0].items():
        if got["guards"]:  # p = 2: the audit and the finiteness guard still see FSDP2's shards
            param, audit, finite = got["guards"]
            assert f"{param} differs across the tensor-parallel group" in audit and "rank 1" in audit, audit
            assert "non-finite parameters" in finite, finite
        assert all(r[name]["losses"] == got["losses"] for r in per_rank), f"{name}: ranks disagree"
        # float32: the layouts sum the same products in other orders (TP matmul splits, the dp reduce-scatter)
        assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5, abs=1e-6), name
        # the clipping norm counts each element once across tp and FSDP2's dp shards: a shard counted per rank,
        # or a missing dp sum, would move it far past float noise
        assert got["norms"] == pytest.approx(expected["norms"], rel=1e-5), name


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("zero3_p1")
    (ranks,) = run_distributed(_layouts_worker, 1, 1, [("p1", overrides(data_dir, tmp / "p1", 1))])
    return ranks["p1"]


def test_zero3_at_dp2_trains_like_one_rank_in_at_most_055x_the_bytes(data_dir, tmp_path, reference):
    world2 = run_distributed(_layouts_worker, 2, 1, [
        ("p1dp2_zero3", overrides(data_dir, tmp_path / "a", 1, ZERO3)),
        ("p1dp2_zero0", overrides(data_dir, tmp_path / "b", 1, ZERO0))])
    _compare(world2, reference)
    assert all(r["p1dp2_zero3"]["sharded"] and not r["p1dp2_zero0"]["sharded"] for r in world2)
    # 2 micro-batches per rank and step: one reduce-scatter per FSDP2 group (each layer, the root) and step; the
    # accumulation micro-batch (set_requires_gradient_sync(False)) issues none, else each would appear twice
    zero3 = world2[0]["p1dp2_zero3"]
    assert zero3["reduce_scatters"] == [zero3["groups"]] * STEPS and world2[0]["p1dp2_zero0"]["reduce_scatters"] \
        == [0] * STEPS, zero3["reduce_scatters"]
    sharded, whole = (max(r[name]["bytes"] for r in world2) for name in ("p1dp2_zero3", "p1dp2_zero0"))
    assert sharded <= 0.55 * whole, (sharded, whole)


def test_zero3_at_p2_dp2_with_sequence_parallelism_trains_like_one_rank(data_dir, tmp_path, reference):
    world4 = run_distributed(_layouts_worker, 4, 2, [
        ("p2dp2_sp_zero3", overrides(data_dir, tmp_path / "a", 2, ZERO3, "--parallel.sequence_parallel=true"))])
    _compare(world4, reference)


@pytest.mark.slow
def test_zero3_at_p2_dp2_without_sequence_parallelism_trains_like_one_rank(data_dir, tmp_path, reference):
    world4 = run_distributed(_layouts_worker, 4, 2, [
        ("p2dp2_zero3", overrides(data_dir, tmp_path / "a", 2, ZERO3)),
        ("p2dp2_zero3_recompute", overrides(data_dir, tmp_path / "b", 2, ZERO3, "--model.recompute_activations=true"))])
    _compare(world4, reference)


def test_zero_stage_2_is_refused_by_name(data_dir, tmp_path):
    from launch import ROOT
    from parallel_attention.training import load_config

    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", overrides(data_dir, tmp_path, 1, "--parallel.zero_stage=2"))
    with pytest.raises(ConfigError, match=r"parallel.zero_stage=2 is not supported.*--parallel.zero_stage=3"):
        cfg.validate(2)
    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", overrides(data_dir, tmp_path, 1, "--parallel.zero_stage=4"))
    with pytest.raises(ConfigError, match=r"parallel.zero_stage=4 is out of range"):
        cfg.validate(2)


def _checkpoint_worker(data_dir, tmp) -> dict:
    out = {}
    run = build_run(overrides(data_dir, tmp / "a", 1, ZERO3))  # p1 dp2, ZeRO-3
    out["a"] = train_steps(run, 2)
    checkpoint(run)
    out["a"] += train_steps(run, 2)
    run = build_run(overrides(data_dir, tmp / "zero0", 1, ZERO0))  # the same at zero_stage 0, for its files
    train_steps(run, 2)
    checkpoint(run)
    run = build_run(overrides(data_dir, tmp / "a", 1, ZERO3))  # exact resume at the same layout
    resume_run(run, "auto")
    out["a_resumed"] = train_steps(run, 2)
    run = build_run(overrides(data_dir, tmp / "b", 1, ZERO1))  # the ZeRO-3 checkpoint at zero_stage 1
    resume_run(run, str(tmp / "a" / "checkpoints" / "step_0000002"))
    out["b"] = train_steps(run, 2)
    if dist.get_rank() == 0:
        shutil.copytree(tmp / "a" / "checkpoints" / "step_0000002", tmp / "c" / "checkpoints" / "step_0000002")
    dist.barrier()
    run = build_run(overrides(data_dir, tmp / "c", 2))  # p2 dp1 from the ZeRO-3 checkpoint: resharded
    resume_run(run, "auto")
    out["c"] = train_steps(run, 1)
    checkpoint(run)  # step 3, at p = 2
    run = build_run(overrides(data_dir, tmp / "d", 1, ZERO3))  # back to p1 dp2 at ZeRO-3: resharded
    resume_run(run, str(tmp / "c" / "checkpoints" / "step_0000003"))
    out["d"] = train_steps(run, 1)
    return out


@pytest.fixture(scope="module")
def zero3_runs(data_dir, tmp_path_factory):
    return run_checkpoint_scenario(_checkpoint_worker, data_dir, tmp_path_factory, "zero3")


def test_zero3_checkpoints_resume_exactly_and_reshard_across_stages_and_p(zero3_runs):
    got = check_resumes_and_reshards(zero3_runs[0], ("a", "a_resumed", "b", "c", "d"))
    # another reduction (DDP's all-reduce, or p = 2's matmul split) sums the same products in another order
    assert got["b"] == pytest.approx(got["a"][2:], rel=1e-5)
    assert got["c"] == pytest.approx(got["a"][2:3], rel=1e-5)


def test_zero3_checkpoint_files_are_those_of_an_unsharded_run(zero3_runs):
    _, tmp = zero3_runs
    sharded, plain = (tmp / run / "checkpoints" / "step_0000002" for run in ("a", "zero0"))
    assert sorted(p.name for p in sharded.iterdir()) == sorted(p.name for p in plain.iterdir())
    for name in ("model_tp00.safetensors", "optim_tp00.safetensors"):
        (mine, mine_meta), (theirs, theirs_meta) = read_safetensors(sharded / name), read_safetensors(plain / name)
        assert mine.keys() == theirs.keys() and mine_meta.keys() == theirs_meta.keys(), name
        for key in theirs:  # whole tensors (gathered over dp), not shards; equal up to the reductions' order
            assert mine[key].shape == theirs[key].shape and mine[key].dtype == theirs[key].dtype, key
            torch.testing.assert_close(mine[key], theirs[key], rtol=1e-4, atol=1e-6, msg=key)
