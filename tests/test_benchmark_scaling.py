"""benchmarks/benchmark_scaling.py: the launch order rotates, the scaling is each round's ratio of two neighbouring
launches, bad arguments are refused with the value named, and end to end on a tiny config the JSON holds one
benchmark_training.py median per size and round."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys

import pytest

from launch import ROOT, environment
from test_pretrain import data_dir, tiny_args  # noqa: F401 (data_dir is a fixture)

pytestmark = pytest.mark.bench  # a benchmark script's own test: python -m pytest -q -m bench

sys.path.insert(0, str(ROOT / "benchmarks"))  # where the script finds its helpers (_bench_training_timing)
_SPEC = importlib.util.spec_from_file_location("benchmark_scaling", ROOT / "benchmarks" / "benchmark_scaling.py")
benchmark_scaling = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(benchmark_scaling)


def test_launch_order_rotates_so_each_size_goes_first_in_turn():
    assert [benchmark_scaling.launch_order([1, 2], i) for i in range(3)] == [[1, 2], [2, 1], [1, 2]]
    assert [benchmark_scaling.launch_order([1, 2, 4], i) for i in range(3)] == [[1, 2, 4], [2, 4, 1], [4, 1, 2]]


def test_scaling_is_the_median_of_per_round_ratios_not_of_medians():
    step_ms = {1: [1000.0, 1600.0, 1500.0], 2: [500.0, 1000.0, 1000.0]}
    result = benchmark_scaling.scaling(step_ms, 1)
    assert list(result) == [2]
    assert result[2]["per_round"] == pytest.approx([2.0, 1.6, 1.5])
    assert result[2]["median"] == pytest.approx(1.6)
    assert result[2]["q1"] == pytest.approx(1.55) and result[2]["q3"] == pytest.approx(1.8)
    assert result[2]["ratio_of_medians"] == pytest.approx(1.5 / 1.0)


@pytest.mark.parametrize("argv, named", [
    (["--sizes=1,x"], "'1,x'"),
    (["--sizes=2"], "[2]"),
    (["--sizes=1,1"], "[1, 1]"),
    (["--rounds=0"], "--rounds=0"),
    (["--parallel.tensor_parallel_size=2"], "--parallel.tensor_parallel_size=2"),
    (["--logging.run_dir=/tmp/x"], "--logging.run_dir=/tmp/x"),
    (["stray"], "stray"),
])
def test_bad_arguments_are_refused_naming_the_value(argv, named, capsys):
    with pytest.raises(SystemExit):
        benchmark_scaling.parse_args(["--config", "c.yaml", "--out", "o.json", *argv])
    assert named in capsys.readouterr().err


def test_end_to_end_one_median_per_size_and_round(data_dir, tmp_path):  # noqa: F811
    out = tmp_path / "scaling.json"
    overrides = [a for a in tiny_args(data_dir, tmp_path / "unused", 1, 1)
                 if not a.startswith(benchmark_scaling.RESERVED)]
    command = [sys.executable, str(ROOT / "benchmarks" / "benchmark_scaling.py"), *overrides, "--rounds", "1",
               "--iters", "1", "--warmup", "0", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-6000:]
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["sizes"] == [1, 2] and result["order"] == [[1, 2]]  # one round: two launches keep CI short
    assert len(result["commands"]) == 2 and all("--no-variants" in c for c in result["commands"])
    for size in (1, 2):
        run = json.loads((tmp_path / f"scaling.json.runs/round0_p{size}.json").read_text())
        assert run["tensor_parallel_size"] == size and run["data_parallel_size"] == 1
        assert set(run["variants_ms"]) == {"ours"}  # --no-variants --no-baselines: our step alone
        assert result["step_ms"][str(size)] == [run["step_ms"]["median"]]
    ratios = [a / b for a, b in zip(result["step_ms"]["1"], result["step_ms"]["2"])]
    assert result["scaling"]["2"]["per_round"] == pytest.approx(ratios)
    assert result["scaling"]["2"]["median"] == pytest.approx(statistics.median(ratios))
