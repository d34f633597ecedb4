"""scripts/benchmark_lockstep.py: bad arguments are refused naming the value, and end to end the JSON's ratios are
each round's lockstep pass over its free pass (each the slowest rank's), with the ceiling ranks / their median."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys

import pytest

from launch import ROOT, environment

_SPEC = importlib.util.spec_from_file_location("benchmark_lockstep", ROOT / "scripts" / "benchmark_lockstep.py")
benchmark_lockstep = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(benchmark_lockstep)


@pytest.mark.parametrize("argv, named", [(["--ranks=1"], "--ranks=1"), (["--rounds=0"], "--rounds=0"),
                                         (["--segments=0"], "--segments=0"), (["--gemms=-1"], "--gemms=-1"),
                                         (["--timeout=0"], "--timeout=0.0")])
def test_bad_arguments_are_refused_naming_the_value(argv, named, capsys):
    with pytest.raises(SystemExit):
        benchmark_lockstep.parse_args(["--out", "o.json", *argv])
    assert named in capsys.readouterr().err


def test_end_to_end_ratios_are_per_round_lockstep_over_free(tmp_path):
    out = tmp_path / "lockstep.json"
    command = [sys.executable, str(ROOT / "scripts" / "benchmark_lockstep.py"), "--rounds", "3", "--segments", "4",
               "--gemms", "1", "--timeout", "120", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text(encoding="utf-8"))
    assert len(result["free_ms"]) == len(result["lockstep_ms"]) == 3 and min(result["free_ms"]) > 0
    for kind in ("free", "lockstep"):  # each pass is its slowest rank's
        assert result[f"{kind}_ms"] == [max(ranks) for ranks in result["per_rank_ms"][kind]]
        assert all(len(ranks) == 2 for ranks in result["per_rank_ms"][kind])
    assert result["per_round"] == pytest.approx([lo / fr for lo, fr in zip(result["lockstep_ms"], result["free_ms"])])
    median = statistics.median(result["per_round"])
    assert result["lockstep_over_free"]["median"] == pytest.approx(median)
    assert result["scaling_ceiling"] == pytest.approx(2 / median)
    assert "scale by at most" in done.stderr


def _dies(rank, args, start, barrier, results):
    if rank == 1:
        raise SystemExit(3)
    benchmark_lockstep._rank(rank, args, start, barrier, results)


def test_a_rank_that_dies_is_named_instead_of_a_hang(monkeypatch):
    """The other rank's barrier gives up after --timeout; the parent names the dead rank well before that."""
    monkeypatch.setattr(benchmark_lockstep, "_rank", _dies)
    args = benchmark_lockstep.parse_args(["--out", "o.json", "--rounds", "1", "--segments", "1", "--timeout", "30"])
    with pytest.raises(SystemExit, match=r"rank\(s\) \[1\] exited with \[3\]"):
        benchmark_lockstep.measure(args)
