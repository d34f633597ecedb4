"""benchmarks/data_wait.py: the share of a step spent waiting for data, read from a finished run's files."""

import json
import subprocess
import sys

import pytest
import yaml

from launch import ROOT

pytestmark = pytest.mark.bench  # a benchmark script's own test: python -m pytest -q -m bench


def test_the_wait_is_measured_against_the_step_and_the_first_step_apart(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"training": {"global_batch_size": 4},
                                                          "data": {"seq_len": 250}}))
    rows = [{"step": 0, "val_loss": 5.0}, {"step": 1, "data_wait_s": 0.5, "tokens_per_s": 1000.0},
            {"step": 10, "data_wait_s": 0.001, "tokens_per_s": 1000.0},
            {"step": 20, "data_wait_s": 0.003, "tokens_per_s": 500.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "data_wait.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True, timeout=60)
    figures = json.loads(out.stdout)
    # steps take 1000 tokens / rate: 1 s and 2 s; waits 1 ms and 3 ms
    assert figures["steps"] == 2 and figures["median_step_s"] == pytest.approx(1.5)
    assert figures["median_wait_s"] == pytest.approx(0.002) and figures["worst_share"] == pytest.approx(0.0015)
    assert figures["first_step"] == {"step": 1, "wait_s": 0.5, "share": pytest.approx(0.5)}
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text((tmp_path / "config.yaml").read_text())
    (empty / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "data_wait.py"), str(empty)],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "no step with data_wait_s" in refused.stderr
