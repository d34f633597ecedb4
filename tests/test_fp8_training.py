"""FP8 training through the trainer, a Llama-style model (SwiGLU, RMSNorm, rotary, grouped kv heads, untied, no
biases) with global scales: TP 2 + SP, DP 2, CP 2, pp 2 (1f1b and zero bubble), ZeRO-3 (tensorwise) and TP 2 + SP,
DP 2 and TP 2 + SP x DP 2 (rowwise and tensorwise) give one process's FP8 losses, gradient norms and final validation
loss within 1e-5 for 12 steps; recompute is bit-identical; the final loss is within 2 % of float32's. One micro-batch
per rank and step: a global scale is the amax of the micro-batch the dp ranks run together, which one process sees
as one micro-batch only then. Every run evaluates the same 16 validation windows (eval_batches x micro-batch size).

What "equal" can mean in FP8. Measured per quantized tensor, element by element, against one process: every FP8
scale of every layout equals one process's exactly at every step before the first rounding flip (the amax groups are
right). What differs is float32's last bits: a layout's sums run in another order (the row-parallel all-reduce, the
data-parallel sum of the gradients, CP's merge), and AdamW amplifies a gradient's difference by lr / eps where the
gradient is near eps (dp 2, step 1: an embedding row's 2.79e-9 against 2.77e-9 moves it 1.7e-6, 6e-5 of its value;
the FP8 linears' weights move a few ulps). Where such a value lies on an FP8 rounding boundary it rounds the other
way (12 % of one element; a whole feature when it is a weight), and quantizing the gradients turns that into 1e-5 to
1e-3 of the gradient norm. No choice of scales removes it, and whether a flip lands within 12 steps is chance: over
seeds 1234, 7, 99, 1, 2, 3 and 4 x the seven acceptance layouts at two ranks, 44 of 49 held 1e-5 against one process
running the step as one micro-batch (the five others, seed 3 tensorwise at dp 2, cp 2, ZeRO-3 and seed 99 rowwise at
TP 2 + SP, dp 2, from step 5: losses 3e-5, norms 6e-4 to 5e-3). This file's seed (1234) holds at every layout by 20x
or more (losses and val within 2e-7, norms 5e-7); with biases (each a sum of dY, often near eps) flips come sooner."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from launch import torchrun, train_losses
from tiny_run import tiny_args

from parallel_attention.checkpointing.tensor_io import read_safetensors
from parallel_attention.training.evaluation import evaluate
from parallel_attention.training.trainer import train_step
from test_data_parallel import build_run, data_dir, overrides  # noqa: F401  (data_dir is a fixture)

STEPS, VAL_WINDOWS = 12, 16
LLAMA = ("--model.activation=swiglu", "--model.norm=rmsnorm", "--model.position_embedding=rotary",
         "--model.tie_embeddings=false", "--model.num_kv_heads=2", "--model.qkv_bias=false", "--model.out_bias=false",
         "--model.mlp_bias=false")
TENSORWISE, ROWWISE = (("--training.fp8=tensorwise", "--training.fp8_global_scales=true"),
                       ("--training.fp8=rowwise", "--training.fp8_global_scales=true"))
SP, PP = "--parallel.sequence_parallel=true", "--parallel.pipeline_parallel_size=2"


def _layouts_worker(layouts: list[tuple[str, list[str]]], steps: int = STEPS) -> dict:
    """Each named layout: `steps` of the trainer's train_step (each enters the run's FP8 policy), then the
    validation loss."""
    results = {}
    for name, args in layouts:
        run = build_run(args)
        records = [train_step(run) for _ in range(steps)]
        results[name] = {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
                         "val": evaluate(run)["val_loss"]}
    return results


def _args(data_dir, tmp_path, name, tp, micro_batch, *extra, steps=STEPS):
    """overrides() for the Llama-style model at `steps` steps, `micro_batch` sequences per rank and micro-batch (a
    step is 8 sequences), the same validation windows at every micro-batch size."""
    return name, overrides(data_dir, tmp_path / name, tp, f"--training.max_steps={steps}",
                           f"--training.micro_batch_size={micro_batch}",
                           f"--training.eval_batches={VAL_WINDOWS // micro_batch}", *LLAMA, *extra)


def _assert_trains_like(got: dict, expected: dict, name: str) -> None:
    """Losses and gradient norms at every step, and the validation loss, within 1e-5 (above: what FP8 allows)."""
    assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5), name
    assert got["norms"] == pytest.approx(expected["norms"], rel=1e-5), name
    assert got["val"] == pytest.approx(expected["val"], rel=1e-5), name


def test_fp8_layouts_train_like_one_process(data_dir, tmp_path):
    """The acceptance layouts one by one at two ranks, against one process running the step as one micro-batch, and
    pp 2 against one process at its 2 micro-batches of 4. dp 2 and ZeRO-3 also match one process accumulating the
    same two micro-batches of 4, more closely still: DDP's sum of two ranks' gradients is accumulation's sum of two
    micro-batches, addition for addition (measured over seeds 1234, 7, 99: dp 2's gradient norms equal, losses within
    1e-7; ZeRO-3's reduce-scatter within 4e-7), where against one micro-batch of 8 a flip is chance (above)."""
    (one,) = run_distributed(_layouts_worker, 1, 1, [
        _args(data_dir, tmp_path, "tensorwise", 1, 8, *TENSORWISE),
        _args(data_dir, tmp_path, "rowwise", 1, 8, *ROWWISE),
        _args(data_dir, tmp_path, "tensorwise_ga2", 1, 4, *TENSORWISE),
        _args(data_dir, tmp_path, "rowwise_ga2", 1, 4, *ROWWISE),
        _args(data_dir, tmp_path, "recompute", 1, 8, "--model.recompute_activations=true", *TENSORWISE),
        _args(data_dir, tmp_path, "float32", 1, 8)])
    (two, _) = run_distributed(_layouts_worker, 2, 1, [
        _args(data_dir, tmp_path, "tp2_sp", 2, 8, SP, *TENSORWISE), _args(data_dir, tmp_path, "dp2", 1, 4, *TENSORWISE),
        _args(data_dir, tmp_path, "cp2", 1, 8, "--parallel.context_parallel_size=2", *TENSORWISE),
        _args(data_dir, tmp_path, "pp2", 1, 4, PP, *TENSORWISE),
        _args(data_dir, tmp_path, "pp2_zero_bubble", 1, 4, PP, "--parallel.pipeline_schedule=zero_bubble", *TENSORWISE),
        _args(data_dir, tmp_path, "zero3", 1, 4, "--parallel.zero_stage=3", *TENSORWISE),
        _args(data_dir, tmp_path, "rowwise_tp2_sp", 2, 8, SP, *ROWWISE),
        _args(data_dir, tmp_path, "rowwise_dp2", 1, 4, *ROWWISE)])
    assert one["recompute"] == one["tensorwise"]
    for name, got in two.items():
        recipe = "rowwise" if name.startswith("rowwise") else "tensorwise"
        if not name.startswith("pp2"):
            _assert_trains_like(got, one[recipe], name)
        if name.startswith(("pp2", "dp2", "zero3", "rowwise_dp2")):
            _assert_trains_like(got, one[f"{recipe}_ga2"], name)
    for recipe in ("tensorwise", "rowwise"):
        assert one[recipe]["losses"] != one["float32"]["losses"], recipe  # FP8 did run
        assert one[recipe]["losses"][-1] == pytest.approx(one["float32"]["losses"][-1], rel=0.02), recipe


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_at_tp2_sp_dp2_trains_like_one_process(data_dir, tmp_path, recipe):
    """TP 2 + SP and DP 2 together, on four ranks: every rank reports the same numbers, one process's."""
    fp8 = TENSORWISE if recipe == "tensorwise" else ROWWISE
    (one,) = run_distributed(_layouts_worker, 1, 1, [_args(data_dir, tmp_path, "one", 1, 8, *fp8)])
    ranks = run_distributed(_layouts_worker, 4, 2, [_args(data_dir, tmp_path, "tp2_sp_dp2", 2, 4, SP, *fp8)])
    assert all(r == ranks[0] for r in ranks)
    _assert_trains_like(ranks[0]["tp2_sp_dp2"], one["one"], recipe)


def _scales_worker(layouts: list[tuple[str, list[str]]], steps: int = 3) -> dict:
    """Each layout's FP8 scales, step by step and in call order: (quantizes a gradient, scale)."""
    from parallel_attention.tensor_parallel import linear_precision as lp

    calls, grads, quantize, methods = [], [], lp.quantize, {}

    def recording(x, scale, dtype):
        calls.append((x.data_ptr() in grads, scale.clone()))
        return quantize(x, scale, dtype)

    def marking(method):  # input_grad(self, grad, ...) and weight_grad(self, grad, ...): dY's memory
        def marked(self, grad, *args):
            grads.append(grad.data_ptr())
            try:
                return method(self, grad, *args)
            finally:
                grads.pop()
        return marked

    lp.quantize = recording
    for cls in (lp.TensorwiseGemms, lp.RowwiseGemms):
        for name in ("input_grad", "weight_grad"):
            methods[cls, name] = getattr(cls, name)
            setattr(cls, name, marking(methods[cls, name]))
    try:
        results = {}
        for name, args in layouts:
            run = build_run(args)
            results[name] = []
            for _ in range(steps):
                calls.clear()
                train_step(run)
                results[name].append(list(calls))
        return results
    finally:
        lp.quantize = quantize
        for (cls, name), method in methods.items():
            setattr(cls, name, method)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_global_scales_at_dp2_and_cp2_are_one_process_s(data_dir, tmp_path, recipe):
    """The training-level check of the dp x cp amax all-reduce (the losses above hardly feel a scale off by two): at
    dp 2 and cp 2, every scale that is not per token equals one process's exactly, call by call, over three steps;
    a gradient's is one process's / 2 (each rank's loss is the mean over its own tokens, so its dY is twice one
    process's). Without global scales they differ (measured per rank and step: tensorwise up to 8 of its 40 scales,
    rowwise 13 to 16 of the 32 compared)."""
    fp8 = TENSORWISE if recipe == "tensorwise" else ROWWISE
    (one,) = run_distributed(_scales_worker, 1, 1, [_args(data_dir, tmp_path, "one", 1, 8, *fp8)])
    ranks = run_distributed(_scales_worker, 2, 1, [_args(data_dir, tmp_path, "dp2", 1, 4, *fp8),
        _args(data_dir, tmp_path, "cp2", 1, 8, "--parallel.context_parallel_size=2", *fp8)])
    for rank in ranks:
        for name, steps in rank.items():
            compared, calls = 0, sum(len(calls) for calls in one["one"])
            for step, (got, expected) in enumerate(zip(steps, one["one"])):
                assert len(got) == len(expected), (name, step)
                for (is_grad, scale), (_, reference) in zip(got, expected):
                    if scale.shape == reference.shape:  # per-token scales ([tokens, 1]) are this rank's tokens'
                        assert torch.equal(scale, reference / 2 if is_grad else reference), (name, step)
                        compared += 1
            assert compared == calls if recipe == "tensorwise" else compared == calls * 2 // 3, name  # W's, dW's


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


@pytest.mark.slow  # test_fp8_layouts_train_like_one_process keeps the 12-step check
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_200_steps_end_within_2_percent_of_float32(data_dir, tmp_path, recipe):
    (one,) = run_distributed(_layouts_worker, 1, 1, [
        _args(data_dir, tmp_path, "fp8", 1, 8, f"--training.fp8={recipe}", "--optimizer.grad_clip=1.0", steps=200),
        _args(data_dir, tmp_path, "fp32", 1, 8, "--optimizer.grad_clip=1.0", steps=200)], 200, timeout=600)
    fp8, fp32 = one["fp8"]["losses"], one["fp32"]["losses"]
    assert len(fp8) == 200 and fp8[-1] == pytest.approx(fp32[-1], rel=0.02), (fp8[-1], fp32[-1])
