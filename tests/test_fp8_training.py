"""FP8 training through the trainer: with global scales, TP 2 + SP x DP 2 trains as one process does in FP8 (losses and
clipped gradient norms within 1e-5, then the drift below), tensorwise and rowwise, and its final loss is within 2 %
of float32's. One micro-batch per step at every layout: a global scale is the amax of the micro-batch the dp ranks
run together, which one process sees as one micro-batch only then.

What "equal" can mean in FP8: the layouts' float32 sums differ in their last bits (about 1e-7 relative, as in float32
training), and where such a value lies on an FP8 rounding boundary it rounds the other way, one step of 6 % in one
element. Such flips appear after a few steps and training amplifies them: measured here, the FP8 losses match one
process's within 2e-6 for 8 steps (most steps within 1e-7), then drift to 1.3e-5 (tensorwise) and 1e-5 (rowwise) by
step 12 (gradient norms to 1.2e-4), while float32's stay within 2e-7. So steps 1-8 are held to 1e-5, steps 9-12 to
5e-5 (losses) and 5e-4 (norms)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from launch import torchrun, train_losses
from tiny_run import tiny_args

from parallel_attention.checkpointing.tensor_io import read_safetensors

from parallel_attention.training.trainer import train_step
from test_data_parallel import build_run, data_dir, overrides  # noqa: F401  (data_dir is a fixture)

STEPS = 12
GLOBAL = ("--training.fp8_global_scales=true",)


def _layouts_worker(layouts: list[tuple[str, list[str]]], steps: int = STEPS) -> dict:
    """Each named layout: `steps` of the trainer's train_step (each enters the run's FP8 policy)."""
    results = {}
    for name, args in layouts:
        run = build_run(args)
        records = [train_step(run) for _ in range(steps)]
        results[name] = {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records]}
    return results


def _args(data_dir, tmp_path, name, tp, dp, *extra, steps=STEPS):
    """overrides() at `steps` steps, one micro-batch of 8 / dp sequences per rank and step."""
    return name, overrides(data_dir, tmp_path / name, tp, f"--training.max_steps={steps}",
                           f"--training.micro_batch_size={8 // dp}", *extra)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_at_tp2_sp_dp2_trains_like_one_process(data_dir, tmp_path, recipe):
    fp8 = (f"--training.fp8={recipe}", *GLOBAL)
    (one,) = run_distributed(_layouts_worker, 1, 1, [_args(data_dir, tmp_path, "fp8", 1, 1, *fp8),
                                                     _args(data_dir, tmp_path, "fp32", 1, 1)])
    ranks = run_distributed(_layouts_worker, 4, 2, [
        _args(data_dir, tmp_path, "tp2_sp_dp2", 2, 2, "--parallel.sequence_parallel=true", *fp8)])
    got, expected = ranks[0]["tp2_sp_dp2"], one["fp8"]
    assert all(r["tp2_sp_dp2"] == got for r in ranks)
    for key, drift in (("losses", 5e-5), ("norms", 5e-4)):  # one process's scales; rounding flips drift (above)
        assert got[key][:8] == pytest.approx(expected[key][:8], rel=1e-5), key
        assert got[key] == pytest.approx(expected[key], rel=drift), key
    assert expected["losses"] != one["fp32"]["losses"]  # FP8 did run
    assert expected["losses"][-1] == pytest.approx(one["fp32"]["losses"][-1], rel=0.02)


def test_fp8_compositions_train_like_one_process(data_dir, tmp_path):
    """Tensorwise with global scales: recompute gives bit-identical losses and norms; pp 2 (1f1b, and zero bubble
    with its deferred dW) equals one process at the same micro-batches; ZeRO-3 at dp 2 and cp 2 as TP x DP above,
    cp's rounding flips sooner (measured: cp 2 within 1e-5 for 4 steps, 2e-5 by 12; norms 1.2e-4)."""
    fp8 = ("--training.fp8=tensorwise", *GLOBAL)
    pp = ("--parallel.pipeline_parallel_size=2", "--training.micro_batch_size=4")
    (one,) = run_distributed(_layouts_worker, 1, 1, [
        _args(data_dir, tmp_path, "ga1", 1, 1, *fp8), _args(data_dir, tmp_path, "ga2", 1, 2, *fp8),
        _args(data_dir, tmp_path, "recompute", 1, 1, "--model.recompute_activations=true", *fp8)])
    (two, _) = run_distributed(_layouts_worker, 2, 1, [
        _args(data_dir, tmp_path, "pp2", 1, 2, *pp, *fp8),
        _args(data_dir, tmp_path, "pp2_zero_bubble", 1, 2, *pp, "--parallel.pipeline_schedule=zero_bubble", *fp8),
        _args(data_dir, tmp_path, "zero3", 1, 2, "--parallel.zero_stage=3", *fp8),
        _args(data_dir, tmp_path, "cp2", 1, 1, "--parallel.context_parallel_size=2", *fp8)])
    assert one["recompute"] == one["ga1"]
    for name, reference, exact_steps, drift in (("pp2", "ga2", 12, 1e-5), ("pp2_zero_bubble", "ga2", 12, 1e-5),
                                                 ("zero3", "ga1", 8, 5e-5), ("cp2", "ga1", 4, 5e-5)):
        got, expected = two[name], one[reference]
        assert got["losses"][:exact_steps] == pytest.approx(expected["losses"][:exact_steps], rel=1e-5), name
        assert got["losses"] == pytest.approx(expected["losses"], rel=drift), name
        assert got["norms"] == pytest.approx(expected["norms"], rel=10 * drift), name

def test_checkpoints_stay_high_precision_and_resume_across_fp8(shared_data, tmp_path):
    """pretrain.py: an FP8 run's checkpoint holds float32 weights and resumes without FP8, and that run's
    checkpoint resumes in FP8 (rowwise, global scales): FP8 is a runtime setting, never the checkpoint's. The
    trainer does enter FP8: step 2 differs from a float32 run's (within 2 %)."""
    run_dir = tmp_path / "run"
    for steps, fp8 in ((2, ("--training.fp8=tensorwise",)), (3, ()),
                       (4, ("--training.fp8=rowwise", "--training.fp8_global_scales=true"))):
        torchrun("pretrain.py", 1, tiny_args(shared_data, run_dir, 1, steps, "--checkpoint.interval=1", *fp8))
    assert sorted(train_losses(run_dir)) == [1, 2, 3, 4]
    torchrun("pretrain.py", 1, tiny_args(shared_data, tmp_path / "float32", 1, 2))
    fp8_losses, float32_losses = train_losses(run_dir), train_losses(tmp_path / "float32")
    assert fp8_losses[2] != float32_losses[2] and fp8_losses[2] == pytest.approx(float32_losses[2], rel=0.02)
    tensors, _ = read_safetensors(run_dir / "checkpoints" / "step_0000004" / "model_tp00.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.float32}


@pytest.mark.slow  # about a minute; test_fp8_at_tp2_sp_dp2_trains_like_one_process keeps the 12-step check
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_200_steps_end_within_2_percent_of_float32(data_dir, tmp_path, recipe):
    (one,) = run_distributed(_layouts_worker, 1, 1, [
        _args(data_dir, tmp_path, "fp8", 1, 1, f"--training.fp8={recipe}", "--optimizer.grad_clip=1.0", steps=200),
        _args(data_dir, tmp_path, "fp32", 1, 1, "--optimizer.grad_clip=1.0", steps=200)], 200, timeout=600)
    fp8, fp32 = one["fp8"]["losses"], one["fp32"]["losses"]
    assert len(fp8) == 200 and fp8[-1] == pytest.approx(fp32[-1], rel=0.02), (fp8[-1], fp32[-1])
