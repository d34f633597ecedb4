"""benchmarks/benchmark_long_context.py and benchmarks/activation_memory.py --cp: end to end under torchrun at world
2 on tiny sizes, the JSON fields each writes (no timing asserts), the paired ratios, and the cp variants refused in
one process with the variant named."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from launch import ROOT, environment

pytestmark = pytest.mark.bench  # a benchmark script's own test: python -m pytest -q -m bench

_SPEC = importlib.util.spec_from_file_location("benchmark_long_context",
                                               ROOT / "benchmarks" / "benchmark_long_context.py")
benchmark_long_context = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(benchmark_long_context)
CP_VARIANTS = ["cp2_all_to_all", "cp2_all_to_all_documents", "cp2_ring", "cp2_ring_documents"]


def _run(script: str, nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    command = [*(launcher if nproc > 1 else [sys.executable]), str(ROOT / "benchmarks" / script), *args]
    return subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=300)


def test_paired_ratios_are_the_median_of_per_round_ratios():
    ratios, paired = benchmark_long_context._ratios({"a": [100.0, 300.0, 200.0], "b": [50.0, 100.0, 200.0]})
    assert set(ratios) == set(paired) == {"a_over_b", "b_over_a"}
    assert ratios["a_over_b"] == pytest.approx(200.0 / 100.0)
    assert paired["a_over_b"] == pytest.approx(2.0)  # per round 2, 3, 1
    assert paired["b_over_a"] == pytest.approx(0.5)


def test_the_cp_variants_need_two_ranks_and_say_so(tmp_path):
    done = _run("benchmark_long_context.py", 1, ["--seq-len", "64", "--variants", "cp2_ring", "--out",
                                                 str(tmp_path / "x.json")])
    assert done.returncode != 0 and "cp2_ring" in done.stderr and "--nproc-per-node 2" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_long_context_at_cp2_times_every_variant_in_every_round(tmp_path):
    out = tmp_path / "long.json"
    done = _run("benchmark_long_context.py", 2, ["--seq-len", "128", "--document-len", "32", "--rounds", "5",
                                                 "--warmup", "0", "--out", str(out)])
    assert done.returncode == 0, done.stderr[-6000:]
    report = json.loads(out.read_text())
    names = ["no_documents", "documents", *CP_VARIANTS]
    assert list(report["step_ms"]) == names and list(report["rounds_ms"]) == names
    assert report["settings"]["world_size"] == 2 and report["settings"]["seq_len"] == 128
    for name in names:
        assert report["step_ms"][name]["n"] == 5 and len(report["rounds_ms"][name]) == 5
        assert all(t > 0 for t in report["rounds_ms"][name])
    pairs = {f"{a}_over_{b}" for a in names for b in names if a != b}
    assert set(report["ratios"]) == set(report["paired_ratios"]) == pairs


def test_activation_memory_at_cp2_rows_for_both_kinds_next_to_cp1(tmp_path):
    out = tmp_path / "act.json"
    s, b, h = 32, 1, 64
    done = _run("activation_memory.py", 2, ["--seq", str(s), "--batch", str(b), "--hidden", str(h), "--heads", "4",
                                            "--kv-heads", "2", "--cp", "2", "--out", str(out)])
    assert done.returncode == 0, done.stderr[-6000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["style"], r["recompute"], r["context_parallel_kind"]) for r in rows} == {
        (style, recompute, kind) for style in ("gpt2", "llama") for recompute in ("none", "selective", "full")
        for kind in ("all_to_all", "ring")}
    for r in rows:
        assert r["p"] == 1 and r["cp"] == 2 and not r["sequence_parallel"]
        assert r["over_cp1"] == r["measured_bytes"] / r["cp1_measured_bytes"]
        assert 0 < r["measured_bytes"] < r["cp1_measured_bytes"]
        # the formula at s/2 tokens, plus at most the attention output's second copy ([s/2, b, h]) and
        # all_to_all's three [s] int64 indexes (docs/performance.md, context parallelism)
        assert r["formula_bytes"] <= r["measured_bytes"] <= r["formula_bytes"] + 4 * (s // 2) * b * h + 3 * 8 * s
        if r["recompute"] == "full":  # the layer's input alone: this rank's [s/2, b, h]
            assert r["measured_bytes"] == r["formula_bytes"] == 4 * (s // 2) * b * h
            assert r["over_cp1"] == 0.5
