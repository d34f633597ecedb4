"""Mixture of experts in the trainer (build + train_step, in-process gloo ranks): a Llama-style model with 8 experts,
top-2, the load-balancing and z losses and DeepSeek-V3's balancing bias trains like one process at dp 2 (ZeRO-1 and
ZeRO-3), pp 2 with full recompute, tp 2 + SP with selective recompute, ep 2, ep 4, ep 2 x tp 2 + SP and ep 2 x cp 2:
the same losses, gradient norms, validation losses, auxiliary losses and loads, and bit-identical biases (ep 2 with
ZeRO-1 and ZeRO-3 too, and inside a pipeline); capacity mode at ep 2 x cp 2 drops the one process's slots; an ep 2
checkpoint (ZeRO-1, ZeRO-3 or neither) resumes at tp 2, at ep 2 and at ep 4 like one process, and a tp 2 one at ep 2
with ZeRO-3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import parallel_attention as pa
from distributed import run_distributed
from launch import ROOT
from parallel_attention.checkpointing.tensor_io import read_safetensors
from parallel_attention.tensor_parallel.collectives import full_tensor
from parallel_attention.training import load_config
from parallel_attention.training.evaluation import evaluate
from parallel_attention.training.run.run_dir import release_run_dir
from parallel_attention.training.trainer import build, checkpoint, resume_run, train_step
from tiny_run import MAX_BYTES, VAL_FRACTION

STEPS = 3


@pytest.fixture(scope="module")
def data_dir(shared_data) -> Path:
    """The session's prepared data (tests/conftest.py)."""
    return shared_data


def moe_overrides(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    """gpt_tiny as a Llama-style MoE: SwiGLU experts (8, top-2, width 16) beside a gated shared expert (Qwen2-MoE's),
    RMSNorm, rotary, untied; 8 micro-batches
    of 4 sequences per step at dp 1 (4 rows: every rank of dp 4 evaluates every validation batch); clipping below the norm, so that every step is clipped by the global norm."""
    return ["--model.hidden_size=32", "--model.num_layers=2", "--model.max_seq_len=16", "--data.seq_len=16",
            "--model.activation=swiglu", "--model.norm=rmsnorm", "--model.position_embedding=rotary",
            "--model.tie_embeddings=false", "--model.num_experts=8", "--model.moe_top_k=2",
            "--model.moe_ffn_hidden_size=16", "--model.moe_aux_loss_coeff=0.01", "--model.moe_z_loss_coeff=0.001",
            "--model.moe_router_bias_update_rate=0.01", "--model.moe_shared_expert_ffn_hidden_size=16",
            "--model.moe_shared_expert_gate=true", "--training.global_batch_size=32",
            "--training.micro_batch_size=4", f"--training.max_steps={STEPS}", "--training.eval_batches=2",
            "--schedule.warmup_steps=1", "--optimizer.grad_clip=0.05", "--logging.progress_bar=false",
            "--logging.tensorboard=false", f"--data.data_dir={data_dir}", f"--data.max_bytes={MAX_BYTES}",
            f"--data.val_fraction={VAL_FRACTION}", f"--logging.run_dir={run_dir}", "--parallel.tensor_parallel_size=1",
            *extra]


def _train_worker(args: list[str]) -> dict:
    pa.destroy_model_parallel()
    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", args)
    cfg.validate(dist.get_world_size())
    run = build(cfg)
    records = [train_step(run) for _ in range(STEPS)]
    biases = {name: full_tensor(p.detach()).clone() for name, p in run.model.named_parameters()
              if "e_score_correction" in name}  # FSDP2 (zero_stage 3): the whole of it
    release_run_dir(cfg)  # these ranks live on (tests/rank_pool.py): the next run may use the directory
    return {"records": records, "val_loss": evaluate(run)["val_loss"], "biases": biases}


LAYOUTS = {  # name: (world, extra overrides)
    "dp2": (2, []),
    "dp2_zero3": (2, ["--parallel.zero_stage=3"]),
    "pp2_recompute": (2, ["--parallel.pipeline_parallel_size=2", "--model.recompute_activations=true"]),
    "tp2_sp_selective": (2, ["--parallel.tensor_parallel_size=2", "--parallel.sequence_parallel=true",
                             "--model.recompute_activations=true", "--model.recompute_granularity=selective"]),
    "ep2": (2, ["--parallel.expert_parallel_size=2", "--parallel.zero_stage=0"]),
    "ep4": (4, ["--parallel.expert_parallel_size=4", "--parallel.zero_stage=0"]),
    "ep2_tp2_sp": (4, ["--parallel.expert_parallel_size=2", "--parallel.zero_stage=0",
                       "--parallel.tensor_parallel_size=2", "--parallel.sequence_parallel=true"]),
    "ep2_cp2": (2, ["--parallel.expert_parallel_size=2", "--parallel.zero_stage=0",
                    "--parallel.context_parallel_size=2"]),
    "ep2_cp2_ring": (2, ["--parallel.expert_parallel_size=2", "--parallel.zero_stage=0",
                         "--parallel.context_parallel_size=2", "--parallel.context_parallel_kind=ring"]),
    "tp2": (2, ["--parallel.tensor_parallel_size=2"]),  # without SP: every tp rank routes the same tokens
    # the experts split over the dp ranks of each stage; ChunkReducer leaves them to finalize_grads
    "ep2_pp2": (4, ["--parallel.expert_parallel_size=2", "--parallel.zero_stage=0",
                    "--parallel.pipeline_parallel_size=2"]),
    # ZeRO-1 over dp x cp for the shared parameters, the split experts updated unsharded beside it
    "ep2_zero1": (2, ["--parallel.expert_parallel_size=2", "--parallel.zero_stage=1"]),
    "ep2_pp2_zero1": (4, ["--parallel.expert_parallel_size=2", "--parallel.zero_stage=1",
                          "--parallel.pipeline_parallel_size=2"]),
    # FSDP2: ep 2 = dp 2, so no other rank holds a rank's experts (FSDP2 over that rank alone); the rest over dp
    "ep2_zero3": (2, ["--parallel.expert_parallel_size=2", "--parallel.zero_stage=3"]),
    # FSDP2 at dp 4: the experts sharded over the 2 ranks that hold the same ones, the rest over all 4
    "ep2_dp4_zero3": (4, ["--parallel.expert_parallel_size=2", "--parallel.zero_stage=3"]),
}


@pytest.fixture(scope="module")
def one_process(data_dir, tmp_path_factory) -> dict:
    return run_distributed(_train_worker, 1, 1, moe_overrides(data_dir, tmp_path_factory.mktemp("one")))[0]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_moe_layouts_train_like_one_process(data_dir, one_process, tmp_path, layout):
    world, extra = LAYOUTS[layout]
    ranks = run_distributed(_train_worker, world, 1, moe_overrides(data_dir, tmp_path / layout, *extra))
    assert {"moe_aux_loss", "moe_z_loss", "moe_load/0", "moe_load/1"} <= set(one_process["records"][0])
    assert_trains_like_one_process(ranks, one_process)


def test_capacity_mode_trains_like_one_process(data_dir, tmp_path):
    """Capacity factor 1.0 (the slots past each expert's capacity dropped, counted over the micro-batch's tokens in
    their global order) at ep 2 x cp 2 (each rank half of every sequence, the slots sent to the other's experts):
    the one process's losses, norms, auxiliary losses, loads, biases and dropped shares, some of them above 0."""
    capacity = "--model.moe_capacity_factor=1.0"
    one = run_distributed(_train_worker, 1, 1, moe_overrides(data_dir, tmp_path / "one", capacity))[0]
    assert max(r[f"moe_dropped/{layer}"] for r in one["records"] for layer in (0, 1)) > 0
    ranks = run_distributed(_train_worker, 2, 1, moe_overrides(data_dir, tmp_path / "ep2_cp2", capacity,
                                                               *LAYOUTS["ep2_cp2"][1]))
    assert_trains_like_one_process(ranks, one, ("moe_dropped/0", "moe_dropped/1"))


def assert_trains_like_one_process(ranks: list[dict], one: dict, more_keys: tuple[str, ...] = ()) -> None:
    """Every rank's records, validation loss and balancing biases against the one process's."""
    expected = one["records"]
    for rank, got in enumerate(ranks):
        for step, (mine, reference) in enumerate(zip(got["records"], expected)):
            for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_load/0", "moe_load/1", *more_keys):
                # float32: the layouts sum the same products in other orders (DP means, TP splits, all-to-alls)
                assert mine[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), f"rank {rank} {key} {step}"
            for layer in (0, 1):  # each expert's share of the routed tokens: the same routing at every layout
                key = f"moe_expert_load/{layer}"
                assert mine[key] == pytest.approx(reference[key], abs=1e-6), f"rank {rank} {key} {step}"
        assert got["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
        for name, bias in got["biases"].items():  # sign updates of integer counts: exactly the one process's
            assert torch.equal(bias, one["biases"][name]), name
    assert set().union(*(got["biases"] for got in ranks)) == set(one["biases"])  # every stage's layers


def _save_worker(args: list[str], steps: int) -> None:
    pa.destroy_model_parallel()
    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", args)
    cfg.validate(dist.get_world_size())
    run = build(cfg)
    for _ in range(steps):
        train_step(run)
    checkpoint(run)
    release_run_dir(cfg)


def _resume_worker(args: list[str]) -> list[dict]:
    pa.destroy_model_parallel()
    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", args)
    cfg.validate(dist.get_world_size())
    run = build(cfg)
    resume_run(run, "auto")
    records = [train_step(run) for _ in range(STEPS - run.step)]
    if run.logger is not None:
        run.logger.close()
    release_run_dir(cfg)
    return records


RESUMED_AT = {"tp2": LAYOUTS["tp2"], "ep4": LAYOUTS["ep4"],
              "ep4_zero1": (4, ["--parallel.expert_parallel_size=4", "--parallel.zero_stage=1"]),
              "ep2": LAYOUTS["ep2"], "ep2_dp4_zero3": LAYOUTS["ep2_dp4_zero3"]}


@pytest.mark.parametrize("saved_at, resumed_at", [("ep2", "tp2"), ("ep2", "ep4"), ("ep2_zero1", "ep4_zero1"),
                                                  ("ep2", "ep4_zero1"), ("ep2_zero1", "ep2"),
                                                  ("ep2_dp4_zero3", "tp2"), ("tp2", "ep2_dp4_zero3"),
                                                  ("ep2_dp4_zero3", "ep2_dp4_zero3")])
def test_an_ep2_checkpoint_resumes_at_another_layout_like_one_process(data_dir, one_process, tmp_path, saved_at,
                                                                     resumed_at):
    """Saved at ep 2 (ZeRO-1, FSDP2 or neither) after step 1 (the experts whole, under their global index, with
    their moments), resumed at tp 2 (ep 1: every expert on each rank), at ep 4 (ZeRO-1 or not), at ep 2 without
    ZeRO, or where it was saved (FSDP2: the exact load, not the resharding one); and saved at tp 2, resumed at ep 2
    under FSDP2: steps 2 and 3 are the uninterrupted one process's."""
    run_dir = tmp_path / "run"
    saved_world, saved_layout = LAYOUTS[saved_at]
    run_distributed(_save_worker, saved_world, 1, moe_overrides(data_dir, run_dir, *saved_layout), 1)
    world, layout = RESUMED_AT[resumed_at]
    for rank_records in run_distributed(_resume_worker, world, 1, moe_overrides(data_dir, run_dir, *layout)):
        assert [r["step"] for r in rank_records] == [2, 3]
        for mine, reference in zip(rank_records, one_process["records"][1:]):
            for key in ("loss", "grad_norm", "moe_aux_loss", "moe_load/1"):
                assert mine[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), (key, mine["step"])


# ZeRO-1 updates every parameter as AdamW does at zero_stage 0 (bit for bit); FSDP2's reduce-scatter averages the
# shared parameters' gradients in another order than DDP (float32: last bits), and the clip coefficient follows
@pytest.mark.parametrize("sharded_at, tolerance", [("ep2_zero1", 0.0), ("ep2_zero3", 1e-5)])
def test_an_ep2_zero_checkpoint_is_the_unsharded_ones(data_dir, tmp_path, sharded_at, tolerance):
    """ZeRO-1 beside the split experts, consolidated, or FSDP2's shards gathered, and the experts made whole on dp
    rank 0: the weights and optimizer files are ep 2 without ZeRO's, tensor for tensor (every parameter and its
    moments, each expert once, under its global index), within `tolerance` of each tensor's largest value."""
    for saved_at in ("ep2", sharded_at):
        run_distributed(_save_worker, 2, 1, moe_overrides(data_dir, tmp_path / saved_at, *LAYOUTS[saved_at][1]), 1)
    for file in ("model_tp00.safetensors", "optim_tp00.safetensors"):
        (plain, plain_meta), (sharded, sharded_meta) = (
            read_safetensors(tmp_path / saved_at / "checkpoints" / "step_0000001" / file)
            for saved_at in ("ep2", sharded_at))
        assert any(".experts." in name for name in plain) and sharded.keys() == plain.keys()
        for name, tensor in plain.items():
            assert sharded[name].shape == tensor.shape, name
            assert (sharded[name] - tensor).abs().max() <= tolerance * tensor.abs().max(), name
        assert {k: json.loads(v) for k, v in sharded_meta.items()} == {k: json.loads(v) for k, v in plain_meta.items()}


def test_ep2_validates_at_every_zero_stage(data_dir, tmp_path):
    """ep 2 runs beside ZeRO-1 (the experts updated unsharded) and FSDP2 (the experts sharded over the ranks that
    hold the same ones)."""
    for stage in (0, 1, 3):
        load_config(ROOT / "configs" / "gpt_tiny.yaml", moe_overrides(
            data_dir, tmp_path, "--parallel.expert_parallel_size=2", f"--parallel.zero_stage={stage}")).validate(2)
