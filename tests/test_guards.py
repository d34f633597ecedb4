"""Run guards under torchrun: ranks launched with different configs stop at once, naming the keys."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from launch import ROOT, environment, run_command, torchrun_command
from test_pretrain import data_dir, tiny_args  # noqa: F401  (data_dir is a fixture)

# torchrun gives every rank the same argv: this wrapper adds rank-specific overrides, as a
# mistyped launch line on one node would
WRAPPER = """import os, runpy, sys
extra = {extra!r}.get(os.environ["RANK"], [])
sys.argv = [{script!r}] + sys.argv[1:] + extra
runpy.run_path({script!r}, run_name="__main__")
"""


def _run_with_rank_overrides(tmp_path: Path, data: Path, extra: dict[str, list[str]], script: str = "pretrain.py",
                             args: list[str] | None = None):
    wrapper = tmp_path / f"per_rank_{script}"
    wrapper.write_text(WRAPPER.format(extra=extra, script=str(ROOT / "scripts" / script)))
    command = torchrun_command(script, 2, args if args is not None else tiny_args(data, tmp_path / "run", 2, 3))
    command[command.index(str(ROOT / "scripts" / script))] = str(wrapper)
    started = time.monotonic()
    result = run_command(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=120)
    return result, time.monotonic() - started


@pytest.mark.parametrize("extra,key", [({"1": ["--training.seed=99"]}, "training.seed"),
                                       pytest.param({"1": ["--training.max_steps=5"]}, "training.max_steps",
                                                    marks=pytest.mark.slow),
                                       pytest.param({"0": ["--optimizer.lr=0.01"]}, "optimizer.lr",
                                                    marks=pytest.mark.slow)])
def test_ranks_with_different_configs_stop_naming_the_key(data_dir, tmp_path, extra, key):  # noqa: F811
    result, waited = _run_with_rank_overrides(tmp_path, data_dir, extra)
    assert result.returncode != 0
    assert "config differs across ranks:" in result.stderr and key in result.stderr, result.stderr[-3000:]
    # said once, by rank 0 (torchrun's failure report may quote it again, indented, as the root cause)
    ours = [line for line in result.stderr.splitlines() if line.startswith("config error: config differs across ranks:")]
    assert len(ours) == 1
    assert waited < 60 and not (tmp_path / "run" / "checkpoints").exists()


def test_generation_ranks_with_different_arguments_stop(data_dir, reference_run, tmp_path):  # noqa: F811
    result, waited = _run_with_rank_overrides(tmp_path, data_dir, {"1": ["--seed=5"]}, "generate.py",
                                              ["--checkpoint", str(reference_run.run), "--max-new-tokens", "4"])
    assert result.returncode != 0 and waited < 60
    assert "arguments differ across ranks:" in result.stderr and "seed: rank 0: 0, rank 1: 5" in result.stderr, \
        result.stderr[-3000:]


def test_self_check_ranks_with_different_arguments_fail(tmp_path):
    wrapper = tmp_path / "check_per_rank.py"
    wrapper.write_text("import os, runpy, sys\nif os.environ['RANK'] == '1': sys.argv.append('--seed=7')\n"
                       "runpy.run_module('parallel_attention.check', run_name='__main__')\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(wrapper)]
    result = run_command(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "arguments differ across ranks" in result.stdout and result.stdout.strip().endswith("check: FAIL setup")
