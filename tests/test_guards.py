"""Run guards under torchrun: ranks launched with different configs stop at once, naming the keys."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from launch import ROOT, environment, torchrun_command
from test_pretrain import data_dir, tiny_args  # noqa: F401  (data_dir is a fixture)

# torchrun gives every rank the same argv: this wrapper adds rank-specific overrides, as a
# mistyped launch line on one node would
WRAPPER = """import os, runpy, sys
extra = {extra!r}.get(os.environ["RANK"], [])
sys.argv = [{script!r}] + sys.argv[1:] + extra
runpy.run_path({script!r}, run_name="__main__")
"""


def _run_with_rank_overrides(tmp_path: Path, data: Path, extra: dict[str, list[str]]):
    wrapper = tmp_path / "pretrain_per_rank.py"
    wrapper.write_text(WRAPPER.format(extra=extra, script=str(ROOT / "scripts" / "pretrain.py")))
    command = torchrun_command("pretrain.py", 2, tiny_args(data, tmp_path / "run", 2, 3))
    command[command.index(str(ROOT / "scripts" / "pretrain.py"))] = str(wrapper)
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=120)
    return result, time.monotonic() - started


@pytest.mark.parametrize("extra,key", [({"1": ["--training.seed=99"]}, "training.seed"),
                                       ({"1": ["--training.max_steps=5"]}, "training.max_steps"),
                                       ({"0": ["--optimizer.lr=0.01"]}, "optimizer.lr")])
def test_ranks_with_different_configs_stop_naming_the_key(data_dir, tmp_path, extra, key):  # noqa: F811
    result, waited = _run_with_rank_overrides(tmp_path, data_dir, extra)
    assert result.returncode != 0
    assert "config differs across ranks:" in result.stderr and key in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("config differs across ranks:") == 1  # said once, by rank 0
    assert waited < 60 and not (tmp_path / "run" / "checkpoints").exists()
