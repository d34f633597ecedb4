"""scripts/gpu_check.sh on a machine without CUDA: --dry-run runs to its end from a fresh copy of the checkout with
an interpreter that lacks this package (and pytest), every step's command resolving and its Python files importing,
and writes its two files and nothing else; the plumbing check names what would not start; the summary reports the
targets whether met or not; the --gpus ring step's comparison holds on gloo."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from launch import ROOT, environment

sys.path.insert(0, str(ROOT / "benchmarks"))
from _gpu_check_archive import LIMIT, pack  # noqa: E402
from _gpu_check_plumbing import problems  # noqa: E402
from _gpu_check_summary import main as summarize  # noqa: E402

STEPS = ["cuda_tests", "probe", "pretrain_bf16", "pretrain_fp16", "flash_sdpa", "kernels", "fp8", "moe",
         "attention_block", "bench_attention", "train_1b", "train_1b_fp8"]
HIDDEN = ("parallel_attention", "__editable__", "pytest", "_pytest", "xdist", "pytest_timeout")


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """An interpreter like a bare GPU image's python3: this environment's packages, but neither this project (no
    editable install: `-S` reads no .pth file) nor pytest."""
    root = tmp_path_factory.mktemp("bare")
    packages = root / "site-packages"
    packages.mkdir()
    for source in map(Path, site.getsitepackages()):
        for entry in source.iterdir():
            if not entry.name.startswith(HIDDEN) and not (packages / entry.name).exists():
                (packages / entry.name).symlink_to(entry)
    python = root / "python3"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{packages}" exec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    return str(python)


def _fresh_clone(tmp_path):
    """The checkout's files as a fresh clone has them (tracked and not ignored), in a new directory."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    clone = tmp_path / "clone"
    for name in listed:
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    return clone


def _files(directory) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


def _dry_run(clone, python, out, *args):
    env = {k: v for k, v in environment().items() if k != "PYTHONPATH"}
    return subprocess.run(["bash", str(clone / "scripts" / "gpu_check.sh"), "--dry-run", *args, str(out)],
                          cwd=out.parent, env={**env, "PYTHON": python, "TMPDIR": str(out.parent)},
                          capture_output=True, text=True, timeout=600)


def test_a_bare_interpreter_lacks_the_package_and_pytest(bare_python, tmp_path):
    for module in ("parallel_attention", "pytest"):
        found = subprocess.run([bare_python, "-c", f"import {module}"], cwd=tmp_path, capture_output=True, text=True,
                               env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=120)
        assert f"No module named '{module}'" in found.stderr
    assert subprocess.run([bare_python, "-c", "import torch, numpy, yaml"], cwd=tmp_path, timeout=120).returncode == 0


def test_the_dry_run_from_a_fresh_clone_with_a_bare_python3_checks_every_step(bare_python, tmp_path):
    clone, out = _fresh_clone(tmp_path), tmp_path / "out" / "gpu_check.json"
    out.parent.mkdir()
    before = _files(clone)
    result = _dry_run(clone, bare_python, out)
    assert result.returncode == 0, result.stderr[-3000:]
    first = result.stderr.splitlines()[:2]
    assert first[0].startswith("torch ") and all(f" {w} " in first[0] for w in ("CUDA", "NCCL", "driver"))
    assert first[1] == "GPU: none visible to torch"
    assert "pytest: not installed for this interpreter: the cuda_tests step is skipped" in result.stderr
    assert "gpu_check: dry run: every step would start but cuda_tests (skipped: see its reason)" in result.stderr
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["dry_run"] and list(summary["steps"]) == STEPS
    assert summary["skipped"] == ["cuda_tests"] and "pip install pytest" in summary["steps"]["cuda_tests"]["status"]
    assert all(step["status"] == "dry_run" for name, step in summary["steps"].items() if name != "cuda_tests")
    assert summary["steps"]["cuda_tests"]["reason"].startswith("skipped: pytest is not installed")
    assert summary["steps"]["cuda_tests"]["log_tail"][0].startswith("skipped: pytest is not installed")
    assert _files(out.parent) == {"gpu_check.json", "gpu_check_logs.tar.gz"}  # the scratch directory is gone
    assert (out.parent / "gpu_check_logs.tar.gz").stat().st_size <= LIMIT
    assert summary["logs"] == str(out.parent / "gpu_check_logs.tar.gz") and summary["steps"]["kernels"]["log"] == (
        "kernels.log")
    assert _files(clone) == before  # nothing written into the checkout


def test_the_dry_run_with_pytest_checks_the_cuda_tests_too(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = _dry_run(ROOT, sys.executable, out)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["ok"] and not summary["skipped"] and list(summary["steps"]) == STEPS


def test_the_gpus_mode_checks_its_multi_gpu_steps(bare_python, tmp_path):
    out = tmp_path / "gpu_check.json"
    result = _dry_run(ROOT, bare_python, out, "--gpus", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["ok"] and list(summary["steps"]) == ["ring_cp", "selfcheck_tp", "selfcheck_cp", "selfcheck_pp",
                                                        "hang_named"]
    bad = _dry_run(ROOT, bare_python, tmp_path / "x.json", "--gpus", "1")
    assert bad.returncode == 2 and "--gpus 1: give the number of GPUs of this machine, 2 or more" in bad.stderr


def _two_ranks(script: str, *args: str) -> dict:
    """A --gpus step's program at world 2 on gloo: rank 0's JSON line (the step must pass)."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(ROOT / "benchmarks" / script), *args], cwd=ROOT, env=environment(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_ring_step_matches_one_sdpa_call_over_the_whole_sequence():
    """The --gpus ring step's program at cp = 2 on gloo, float32, a small block: its comparison passes."""
    report = _two_ranks("_gpu_check_ring.py", "--kv-mib", "0.05")
    assert report["ok"] and report["cp"] == 2 and report["tokens_per_rank"] == 12 and report["worst_error"] <= 1e-5


def test_the_probe_step_runs_its_checks_on_the_cpu():
    """The probe's program on CPU: q, k, v in bf16 under bf16 autocast, the hash's masks equal in blocks and in one
    pass; varlen_attn (CUDA only) skipped, saying so."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "_gpu_check_probe.py"), "--device", "cpu"],
                            cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["autocast"] == {"q": "bfloat16", "k": "bfloat16", "v": "bfloat16", "ok": True}
    assert report["varlen"] == {"skipped": "varlen_attn runs on CUDA only"} and report["dropout_hash"]["ok"]


def test_the_moe_step_runs_its_check_on_the_cpu():
    """The MoE step's program on CPU (bf16 autocast on the CPU's torch._grouped_mm against float32): within its
    tolerance, no token routed otherwise (the router is float32 under autocast too), tokens/s reported."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "_gpu_check_moe.py"), "--device", "cpu",
                             "--shape", "check", "--tokens", "64", "--iters", "1", "--warmup", "0"],
                            cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    agreement = report["agreement"]
    assert report["ok"] and agreement["tokens_flipped"] == 0
    assert all(agreement[name]["ok"] and agreement[name]["error"] <= agreement["tolerance"]
               for name in ("out", "dx", "d_router", "d_gate_up_proj", "d_down_proj"))
    assert report["timing"]["tokens_per_s"] > 0 and report["timing"]["experts"].startswith("torch._grouped_mm")


def test_the_plumbing_check_names_what_would_not_start(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import parallel_attention.no_such_module\n")
    assert problems([sys.executable, str(broken)]) == [
        f"{broken}: its imports fail: ModuleNotFoundError: No module named 'parallel_attention.no_such_module'"]
    assert problems(["no-such-program", "-m", "no_such_module", "missing.py"]) == [
        "program 'no-such-program' is not on PATH", "module 'no_such_module' is not importable", "no file missing.py"]
    kernels = str(ROOT / "benchmarks" / "_gpu_check_kernels.py")
    assert problems([sys.executable, "-m", "torch.distributed.run", kernels]) == []
    skipping = tmp_path / "test_needs_a_missing_package.py"  # as tests/test_fp8_torchao_oracle.py without torchao
    skipping.write_text("import pytest\n\npytest.importorskip('no_such_package_here')\n")
    assert problems([sys.executable, "-m", "pytest", str(skipping)]) == []  # pytest would start and skip it


def test_the_summary_reports_each_target_met_or_not(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "steps.tsv").write_text("attention_block\tpassed\t20\ntrain_1b\tpassed\t60\ntrain_1b_fp8\tpassed\t60\n")
    (logs / "attention_block.log").write_text("warming up\n" + json.dumps({"fraction_of_peak": 0.31}) + "\n")
    (logs / "train_1b.json").write_text(json.dumps({"mfu": 0.45, "tflops": 445.0, "step_ms": 500.0}))
    (logs / "train_1b_fp8.json").write_text(json.dumps({"mfu": 0.56, "step_ms": 400.0}))
    assert summarize(logs, tmp_path / "out.json") == 0  # a missed target does not fail the check
    summary = json.loads((tmp_path / "out.json").read_text())
    assert summary["steps"]["train_1b_fp8"]["result"]["mfu"] == 0.56
    assert summary["steps"]["train_1b_fp8"]["fp8_step_speedup"] == 1.25  # bf16's step over FP8's
    targets = summary["targets"]
    assert targets == {"attention_block": {"fraction_of_peak": 0.31, "target": 0.5, "met": False},
                       "train_1b": {"mfu": 0.45, "target": 0.4, "met": True}}


def test_the_hang_step_names_the_collective_nobody_joined():
    """The --gpus hang step's program at world 2 on gloo with a 3 s timeout: rank 0's error names it."""
    report = _two_ranks("_gpu_check_hang.py", "--timeout-s", "3")
    assert report["ok"] and report["raised"].startswith(
        "all_reduce on the tensor-parallel group (global ranks [0, 1]) did not complete within the timeout (0:00:03)")


def test_a_run_records_each_steps_outcome_and_interrupts_the_one_past_its_limit(tmp_path):
    """The non-dry path with a stand-in python3 that claims a GPU: every step's command "passes" at once, except
    kernels', which prints 41 lines and fails, and flash_sdpa's, which outlives its 25 s limit and is interrupted
    (SIGINT); the versions, the summary and the archive run on the real interpreter. Steps whose facts are missing
    fail their check; the run writes its two files."""
    fake = tmp_path / "python3"
    fake.write_text(f"""#!/bin/sh
case "$1" in benchmarks/_gpu_check_versions.py|benchmarks/_gpu_check_summary.py|benchmarks/_gpu_check_archive.py)
    exec {sys.executable} "$@";; esac
case "$*" in *_gpu_check_flash.py*) exec sleep 120;; esac
case "$*" in *_gpu_check_kernels.py*) seq 1 40; echo "RuntimeError: the kernel refused" >&2; exit 3;; esac
exit 0
""")
    fake.chmod(0o755)
    out = tmp_path / "out" / "gpu_check.json"
    out.parent.mkdir()
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)], cwd=tmp_path,
                            env={**environment(), "PYTHON": str(fake), "TMPDIR": str(out.parent)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    steps = json.loads(out.read_text())["steps"]
    assert {name: step["status"] for name, step in steps.items()} == {
        "cuda_tests": "passed", "probe": "passed", "pretrain_bf16": "failed(check)", "pretrain_fp16": "failed(check)",
        "flash_sdpa": "timeout(25s)", "kernels": "failed(3)", "attention_block": "passed", "bench_attention": "passed",
        "train_1b": "passed", "train_1b_fp8": "passed", "fp8": "passed", "moe": "passed"}
    assert 25 <= steps["flash_sdpa"]["seconds"] <= 25 + 15  # the limit, then at most the grace
    # every step that did not pass says why and ends with its log's last 30 lines
    assert steps["kernels"]["reason"] == "its command exited with status 3"
    assert steps["kernels"]["log_tail"] == [str(i) for i in range(12, 41)] + ["RuntimeError: the kernel refused"]
    assert steps["flash_sdpa"]["reason"] == "interrupted at its limit (25s)"
    assert steps["pretrain_bf16"]["reason"].startswith("it ran to its end, but the facts it reports fail")
    assert "reason" not in steps["cuda_tests"] and "log_tail" not in steps["cuda_tests"]
    assert _files(out.parent) == {"gpu_check.json", "gpu_check_logs.tar.gz"}


def test_the_logs_archive_keeps_logs_and_metrics_not_checkpoints_or_data_under_4_mib(tmp_path):
    """The tiny run's checkpoints and prepared data (incompressible) stay out; a long log keeps its end."""
    logs = tmp_path / "logs"
    for name, size in (("data_tiny/shard_0.bin", 3 * 2**20), ("run_bf16/checkpoints/step_60/model.pt", 6 * 2**20)):
        (logs / name).parent.mkdir(parents=True)
        (logs / name).write_bytes(os.urandom(size))
    (logs / "run_bf16" / "metrics.jsonl").write_text('{"loss": 3.0}\n')
    (logs / "data_tiny" / "meta.json").write_text("{}")
    (logs / "cuda_tests.xml").write_text("<testsuite tests='1'/>")
    (logs / "train_1b.log").write_text("".join(f"line {i}: {os.urandom(32).hex()}\n" for i in range(40000)))
    archive = tmp_path / "gpu_check_logs.tar.gz"
    left_out = pack(logs, archive)
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        log = tar.extractfile("train_1b.log").read().decode()
    assert sorted(names) == ["cuda_tests.xml", "left_out.txt", "run_bf16/metrics.jsonl", "train_1b.log"]
    assert log.startswith("[the first ") and log.endswith("line 39999: " + log.rsplit("line 39999: ", 1)[1])
    assert sorted(left_out) == ["data_tiny/meta.json (not a log, metrics or report)",
                                "data_tiny/shard_0.bin (not a log, metrics or report)",
                                "run_bf16/checkpoints/step_60/model.pt (not a log, metrics or report)"]
    assert archive.stat().st_size <= LIMIT
