"""benchmarks/benchmark_training.py end to end on a tiny config: at p = 1 (GPT-2-style, against GPT2LMHeadModel in
this process) and at p = 2 (Llama-style, against transformers' tp_plan="auto"), the JSON carries every field with
sane values, the baselines agree with our loss before timing, or say why they were skipped."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from launch import ROOT, environment
from test_pretrain import data_dir, tiny_args  # noqa: F401 (data_dir is a fixture)

pytestmark = pytest.mark.bench  # a benchmark script's own test: python -m pytest -q -m bench

LLAMA = ["--model.activation=swiglu", "--model.norm=rmsnorm", "--model.position_embedding=rotary",
         "--model.qkv_bias=false", "--model.out_bias=false", "--model.mlp_bias=false", "--model.num_kv_heads=2"]
FIELDS = {"step_ms", "tokens_per_s", "tflops", "mfu", "exposed_tp_comm_ms", "exposed_dp_comm_ms",
          "optimizer_state_bytes_per_rank", "saved_activation_bytes", "baselines", "config", "variants_ms",
          "rounds_ms"}


def _benchmark(data_dir, tmp_path, world: int, tp: int, *extra: str) -> dict:  # noqa: F811
    out = tmp_path / "bench.json"
    args = tiny_args(data_dir, tmp_path / "run", tp, 1, *extra)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               str(ROOT / "benchmarks" / "benchmark_training.py"), *args, "--iters", "2", "--warmup", "1", "--out",
               str(out)]
    done = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(out.read_text(encoding="utf-8"))


def _check_common(result: dict, variants: set[str]) -> None:
    assert FIELDS <= result.keys()
    assert set(result["variants_ms"]) == variants
    step = result["step_ms"]
    assert step["n"] == 2 and 0 < step["q1"] <= step["median"] <= step["q3"] and step["iqr"] >= 0
    assert result["tokens_per_s"] == pytest.approx(result["tokens_per_step"] / (step["median"] / 1e3))
    assert result["tflops"] > 0 and result["mfu"] == pytest.approx(result["tflops"] / result["peak_tflops"])
    assert result["optimizer_state_bytes_per_rank"] > 0 and result["saved_activation_bytes"] > 0
    rounds = result["rounds_ms"]
    assert rounds.keys() == result["variants_ms"].keys() and all(len(ms) == 2 for ms in rounds.values())
    assert statistics.median(rounds["ours"]) == pytest.approx(step["median"])
    for kind in ("tp", "dp"):  # the median of the paired per-round differences
        off = rounds.get(f"ours_{kind}_comm_off")
        want = statistics.median(a - b for a, b in zip(rounds["ours"], off)) if off else 0.0
        assert result[f"exposed_{kind}_comm_ms"] == pytest.approx(want)


def test_p1_against_gpt2_in_process(data_dir, tmp_path):  # noqa: F811
    result = _benchmark(data_dir, tmp_path, 1, 1)
    _check_common(result, {"ours", "transformers"})
    assert result["exposed_tp_comm_ms"] == result["exposed_dp_comm_ms"] == 0.0  # nothing to communicate
    hf = result["baselines"]["transformers"]
    assert hf["status"] == "ok", hf.get("reason")
    assert hf["architecture"] == "GPT2LMHeadModel" and hf["loss_difference"] <= 1e-5
    assert hf["ours_over_transformers"] > 0


def test_p2_llama_against_transformers_tp_plan(data_dir, tmp_path):  # noqa: F811
    result = _benchmark(data_dir, tmp_path, 2, 2, *LLAMA)
    _check_common(result, {"ours", "ours_tp_comm_off", "transformers"})
    assert result["tensor_parallel_size"] == 2 and result["data_parallel_size"] == 1
    hf = result["baselines"]["transformers"]
    assert hf["status"] == "ok", hf.get("reason")
    assert hf["architecture"] == "LlamaForCausalLM" and hf["tp_plan"] == "auto" and hf["loss_difference"] <= 1e-5


@pytest.mark.slow
def test_dp2_skips_the_baseline_with_a_reason(data_dir, tmp_path):  # noqa: F811
    result = _benchmark(data_dir, tmp_path, 2, 1, "--no-baselines")
    _check_common(result, {"ours", "ours_dp_comm_off"})
    assert result["baselines"]["transformers"] == {"status": "skipped", "reason": "--no-baselines"}
