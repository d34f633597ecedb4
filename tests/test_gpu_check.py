"""scripts/gpu_check.sh on a machine without CUDA: --dry-run runs to its end, every step's command resolving and
its Python files importing; the plumbing check names what would not start; the summary reports the targets
whether met or not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from launch import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from _gpu_check_plumbing import problems  # noqa: E402
from _gpu_check_summary import main as summarize  # noqa: E402

STEPS = ["cuda_tests", "pretrain_bf16", "pretrain_fp16", "flash_sdpa", "kernels", "attention_block",
         "bench_attention", "train_1b"]


def test_the_dry_run_checks_every_step_and_writes_its_summary(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(out)], cwd=ROOT,
                            env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["dry_run"] and list(summary["steps"]) == STEPS
    assert all(step["status"] == "passed" for step in summary["steps"].values()), summary


def test_the_plumbing_check_names_what_would_not_start(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import parallel_attention.no_such_module\n")
    assert problems([sys.executable, str(broken)]) == [
        f"{broken}: its imports fail: ModuleNotFoundError: No module named 'parallel_attention.no_such_module'"]
    assert problems(["no-such-program", "-m", "no_such_module", "missing.py"]) == [
        "program 'no-such-program' is not on PATH", "module 'no_such_module' is not importable", "no file missing.py"]
    kernels = str(ROOT / "benchmarks" / "_gpu_check_kernels.py")
    assert problems([sys.executable, "-m", "torch.distributed.run", kernels]) == []


def test_the_summary_reports_each_target_met_or_not(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "steps.tsv").write_text("attention_block\tpassed\t20\ntrain_1b\tpassed\t60\n")
    (logs / "attention_block.log").write_text("warming up\n" + json.dumps({"fraction_of_peak": 0.31}) + "\n")
    (logs / "train_1b.json").write_text(json.dumps({"mfu": 0.45, "tflops": 445.0}))
    assert summarize(logs, tmp_path / "out.json") == 0  # a missed target does not fail the check
    targets = json.loads((tmp_path / "out.json").read_text())["targets"]
    assert targets == {"attention_block": {"fraction_of_peak": 0.31, "target": 0.5, "met": False},
                       "train_1b": {"mfu": 0.45, "target": 0.4, "met": True}}
