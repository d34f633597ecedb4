"""MFU: model FLOPs per token against a hand count, the peak rate (configured, by GPU name, measured on an
unknown GPU, none on a CPU), and the
tflops / mfu fields of a real training step's metrics row."""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch

from distributed import run_distributed
from parallel_attention.training import flops
from parallel_attention.training.flops import flops_per_token, gpu_table_peak, measured_gemm_tflops, peak_tflops
from parallel_attention.transformer.model_flops import matmul_weights
from parallel_attention.transformer.model import GPTModel
from parallel_attention.transformer.model_config import ModelConfig
from test_data_parallel import build_run
from test_pretrain import data_dir, tiny_args  # noqa: F401 (data_dir is a fixture)

# h 8, nh 2, nkv 1 (GQA), d 4, ffn 16, L 1, V 10: small enough to count by hand
TINY = dict(vocab_size=10, hidden_size=8, num_heads=2, num_kv_heads=1, ffn_hidden_size=16, num_layers=1,
            max_seq_len=5)


@pytest.mark.parametrize("activation, mlp_weights", [("gelu", 2 * 8 * 16), ("swiglu", 3 * 8 * 16)])
def test_flops_per_token_by_hand(activation, mlp_weights):
    cfg = ModelConfig(**TINY, activation=activation)
    qkv, out, lm_head = 8 * (2 + 2 * 1) * 4, 2 * 4 * 8, 8 * 10  # h (nh + 2 nkv) d; nh d h; h V
    n = qkv + out + mlp_weights + lm_head
    assert matmul_weights(cfg) == n
    # per token and layer: QK^T and AV are 2 s nh d FLOPs each forward; x3 for forward + backward; no causal halving
    attention = 3 * (2 * 5 * 2 * 4 + 2 * 5 * 2 * 4)
    assert flops_per_token(cfg, seq_len=5) == 6 * n + attention


@pytest.mark.parametrize("activation, tie", [("gelu", True), ("swiglu", False)])
def test_matmul_weights_are_the_models_weight_matrices(activation, tie):
    """N counted from a built model's parameters: every 2-D weight but the embedding tables, plus the output layer
    (h x V, unpadded: the padding rows are not model FLOPs) whether tied or not."""
    cfg = ModelConfig(**{**TINY, "num_layers": 3}, activation=activation, tie_embeddings=tie)
    model = GPTModel(cfg)
    matrices = sum(p.numel() for name, p in model.named_parameters()
                   if p.dim() == 2 and not name.startswith(("embed_", "lm_head")))
    assert matmul_weights(cfg) == matrices + cfg.hidden_size * cfg.vocab_size


def test_peak_tflops():
    assert peak_tflops(123.0, torch.device("cpu")) == 123.0  # logging.peak_tflops wins
    assert gpu_table_peak("NVIDIA H100 80GB HBM3") == 989.0 and gpu_table_peak("NVIDIA H100 PCIe") == 756.0
    assert gpu_table_peak("NVIDIA H200") == 989.0 and gpu_table_peak("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_table_peak("Some Future GPU") is None
    assert measured_gemm_tflops(torch.device("cpu"), seconds=0.05) > 0  # what an unknown GPU's probe runs


def test_a_cpu_has_no_peak_unless_configured():
    """A GEMM probe on a CPU moved 2x between runs (MFU 23 % to 93 %): no peak, no probe, no mfu in the rows, and
    the run summary says why."""
    from parallel_attention.training.config.schema import PretrainConfig
    from parallel_attention.training.run.summary import run_summary

    cpu, started = torch.device("cpu"), time.perf_counter()
    assert flops.agree_peak_tflops(None, cpu) is None and peak_tflops(None, cpu) is None
    assert time.perf_counter() - started < 0.01  # nothing measured
    rates = flops.step_rates(PretrainConfig(), cpu, tokens_per_step=4096, seconds=0.5)
    assert set(rates) == {"tokens_per_s", "tflops"}
    text = run_summary(PretrainConfig(), GPTModel(ModelConfig(**TINY)), world_size=1)
    assert ("  peak         none on a CPU without logging.peak_tflops (a GEMM probe varies 2x between runs): set it "
            "to the CPU's peak to report MFU") in text.splitlines()


def _agreed_peaks() -> tuple[float, float, float]:
    """On an unknown GPU each rank "measures" its own rate (rank + 1), then the job agrees on one peak."""
    rank = torch.distributed.get_rank()
    gpu, saved = torch.device("cuda", 0), flops._auto_peak  # a device object only: nothing runs on it
    flops._auto_peak = lambda device_type, index: float(rank + 1)
    try:
        return flops.agree_peak_tflops(None, gpu), peak_tflops(None, gpu), flops.agree_peak_tflops(7.0, gpu)
    finally:
        flops._auto_peak, _ = saved, flops._AGREED.pop(gpu, None)


def test_every_rank_reports_mfu_against_the_highest_measured_peak():
    """A rank whose probe ran at a noisy moment no longer gets its own, lower peak: all take the job's highest."""
    assert run_distributed(_agreed_peaks, 2) == [(2.0, 2.0, 7.0)] * 2  # a configured peak still wins


def _credited_flops(pp: int) -> float:
    """The model FLOPs a device is credited with for one step of the same model and batch, at pp stages."""
    import parallel_attention as pa
    from parallel_attention.training.config.schema import PretrainConfig

    pa.destroy_model_parallel()  # the ranks came with tp groups; this layout has pp stages
    pa.initialize_model_parallel(1, pipeline_model_parallel_size=pp)
    return flops.flops_per_device(PretrainConfig(), tokens_per_step=4096)


def test_a_pipeline_stage_is_credited_with_its_share_of_the_steps_flops():
    """At pp 8 a 40 % MFU used to read 320 %: pp divides the step's FLOPs like tp, cp and dp do."""
    one_stage, = run_distributed(_credited_flops, 1, 1, 1)
    two_stages = run_distributed(_credited_flops, 2, 1, 2)
    assert two_stages == [one_stage / 2] * 2


def _one_step_record(data, run_dir) -> tuple[dict, dict]:
    from parallel_attention.training import trainer

    # tiny_args' --config is configs/gpt_tiny.yaml, which build_run reads: pass the overrides after it
    run = build_run(tiny_args(data, run_dir, 1, 2, "--logging.peak_tflops=0.5")[2:])
    trainer.resume_run(run, "none")
    record = trainer.train_step(run)
    run.logger.log(record)
    run.logger.close()
    return record, json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def test_a_training_step_logs_tflops_and_mfu(data_dir, tmp_path):  # noqa: F811
    record, row = run_distributed(_one_step_record, 1, 1, data_dir, tmp_path)[0]
    cfg = ModelConfig(hidden_size=32, num_layers=2, max_seq_len=32, vocab_size=256, num_heads=4)  # tiny_args' model
    assert row == record and {"tflops", "mfu", "tokens_per_s", "peak_tflops"} <= row.keys()
    # one rank: achieved model TFLOP/s = tokens/s x FLOPs per token; MFU against the configured 0.5 TFLOP/s
    assert row["tflops"] == pytest.approx(row["tokens_per_s"] * flops_per_token(cfg, 32) / 1e12, rel=1e-9)
    assert row["peak_tflops"] == max(0.5, row["tflops"]) and row["mfu"] <= 1  # a faster step raises the peak
    assert row["mfu"] == pytest.approx(row["tflops"] / row["peak_tflops"], rel=1e-9)


def _fake_peak(monkeypatch, measured: float) -> torch.device:
    """An unknown GPU whose start-up probe read `measured` TFLOP/s, with no step rate seen yet."""
    device = torch.device("cuda", 0)  # a device object only: nothing runs on it
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    monkeypatch.setattr(flops, "_AGREED", {device: measured})
    monkeypatch.setattr(flops, "_RAISED", {})
    return device


def test_a_step_faster_than_the_measured_peak_raises_it_and_warns_once(monkeypatch):
    """The probe under-measured (a busy host): mfu stays <= 1 and every row's mfu = tflops / peak_tflops."""
    device = _fake_peak(monkeypatch, 2.0)
    assert flops.reported_peak(1.0, None, device) == 2.0
    with pytest.warns(RuntimeWarning, match=r"3 model TFLOP/s per device, above the peak of 2 TFLOP/s: a GEMM rate "
                                            r"measured at start on cuda:0 is below it .* set logging\.peak_tflops"):
        assert flops.reported_peak(3.0, None, device) == 3.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a second, faster step raises the peak again in silence
        assert flops.reported_peak(4.0, None, device) == 4.0
        assert flops.reported_peak(1.0, None, device) == 4.0 == peak_tflops(None, device)


def test_a_configured_peak_below_a_step_is_named_and_mfu_is_capped(monkeypatch):
    device = _fake_peak(monkeypatch, 2.0)
    with pytest.warns(RuntimeWarning, match=r"logging\.peak_tflops=0\.5 is too low for cuda:0"):
        assert flops.reported_peak(0.8, 0.5, device) == 0.8
    assert peak_tflops(0.5, device) == 0.8 and peak_tflops(0.7, device) == 0.7  # another configured figure: its own
    assert peak_tflops(None, device) == 2.0


def test_step_rates_never_report_mfu_above_1(monkeypatch):
    """With a probe that read 1000x too low, the row's mfu is 1 at most and agrees with its peak_tflops."""
    from parallel_attention.training.config.schema import PretrainConfig

    cfg = PretrainConfig()
    device = _fake_peak(monkeypatch, 1e-9)
    with pytest.warns(RuntimeWarning, match="below it"):
        rates = flops.step_rates(cfg, device, tokens_per_step=4096, seconds=0.5)
    assert rates["mfu"] == 1.0 and rates["peak_tflops"] == rates["tflops"] > 1e-9
    slower = flops.step_rates(cfg, device, tokens_per_step=4096, seconds=1.0)
    assert slower["mfu"] == pytest.approx(0.5) and slower["peak_tflops"] == rates["tflops"]
