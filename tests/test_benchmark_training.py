"""benchmarks/benchmark_training.py end to end on a tiny config: at p = 1 (GPT-2-style, against GPT2LMHeadModel in
this process) and at p = 2 (Llama-style, against transformers' tp_plan="auto", and with --baseline against
transformers whole on rank 0 and parallel_attention.parallelize), the JSON carries every field with sane values,
the baselines agree with our loss before timing, or say why they were skipped."""

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
          "parameter_bytes_per_rank", "gradient_bytes_per_rank", "optimizer_state_bytes_per_rank",
          "saved_activation_bytes", "baselines", "config", "variants_ms",
          "rounds_ms"}


def _benchmark(data_dir, tmp_path, world: int, tp: int, *extra: str) -> dict:  # noqa: F811
    out = tmp_path / "bench.json"
    args = tiny_args(data_dir, tmp_path / "run", tp, 1, "--logging.peak_tflops=1", *extra)  # CPU: MFU needs a peak
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


def test_p2_llama_side_by_side_with_transformers_p1_and_parallelize(data_dir, tmp_path):  # noqa: F811
    """issue 24's speed comparison in one world: tp_plan, transformers whole on rank 0, parallelize (clipped with
    parallel_attention.clip_grad_norm_ here: the config clips), each on our weights and alternating with ours."""
    baselines = ("transformers", "transformers_p1", "parallelize")
    result = _benchmark(data_dir, tmp_path, 2, 2, *LLAMA, "--no-variants",
                        *(arg for name in baselines for arg in ("--baseline", name)))
    _check_common(result, {"ours", *baselines})
    assert result["config"]["optimizer"]["grad_clip"] > 0
    hf = result["baselines"]
    assert list(hf) == list(baselines)
    for name in baselines:
        assert hf[name]["status"] == "ok", hf[name].get("reason")
        assert hf[name]["architecture"] == "LlamaForCausalLM" and hf[name]["loss_difference"] <= 1e-5
        assert hf[name]["step_ms"]["median"] == pytest.approx(statistics.median(result["rounds_ms"][name]))
        assert all(ms > 0 for ms in result["rounds_ms"][name])  # it ran every round (rank 0's time for p1)
        assert hf[name][f"ours_over_{name}"] == pytest.approx(step_ratio(result, "ours", name))
    assert hf["transformers"]["tp_plan"] == "auto" and hf["transformers_p1"]["processes"] == 1
    assert hf["parallelize"]["tensor_parallel_size"] == 2
    for other in ("transformers", "transformers_p1"):
        ratio = hf["parallelize"][f"over_{other}"]
        assert ratio["of_medians"] == pytest.approx(step_ratio(result, "parallelize", other))
        paired = [a / b for a, b in zip(result["rounds_ms"]["parallelize"], result["rounds_ms"][other])]
        assert ratio["paired"] == pytest.approx(statistics.median(paired))


def step_ratio(result: dict, a: str, b: str) -> float:
    return statistics.median(result["rounds_ms"][a]) / statistics.median(result["rounds_ms"][b])


def test_an_unknown_baseline_is_refused_by_name(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "benchmark_training.py"), "--baseline", "deepspeed",
               "--out", str(tmp_path / "x.json")]
    done = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "invalid choice: 'deepspeed'" in done.stderr, done.stderr[-2000:]
