"""Every shell command of docs/moe.md runs as written, in page order, shortened (a few steps of a small corpus), in a
scratch working directory: the ep 2 run, then its resumption at tp 2, ep 1, which continues its steps, the self-check
at ep 2, then the picture of the run's expert load."""

from __future__ import annotations

import json
import shlex

import pytest

from launch import ROOT, run_command
from test_readme import INTERPRETERS, page_commands

PAGE = ROOT / "docs" / "moe.md"
# pattern -> why the command is not run here
EXEMPT = {"HOST:PORT": "multi-node placeholders no fixture can fill: test_pretrain.py runs two local agents",
          "path/to/qwen2_moe": "tests/test_moe_hf.py runs these three with the same arguments on each tiny family "
                               "(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)",
          "runs/moe_tp2": "tests/test_moe_hf.py (as above)"}
SHORTEN = ["--training.eval_interval=2", "--checkpoint.interval=2", "--training.eval_batches=1",
           "--data.max_bytes=300000", "--data.seq_len=32", "--logging.progress_bar=false"]


def test_the_page_commands_run_and_the_second_continues_the_first(tmp_path):
    for name in ("scripts", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    commands = [c for c in page_commands(PAGE) if not any(pattern in c for pattern in EXEMPT)]
    trainings = [c for c in commands if "scripts/pretrain.py" in c]
    check = "torchrun --standalone --nproc-per-node 2 -m parallel_attention.check --ep 2"
    assert len(trainings) == 2 and commands[2:] == [check, "python scripts/expert_load.py runs/moe_tiny"]
    for i, command in enumerate(commands):
        words = shlex.split(command)
        shorten = SHORTEN + [f"--training.max_steps={2 * (i + 1)}"] if command in trainings else []
        result = run_command(INTERPRETERS[words[0]] + words[1:] + shorten, cwd=tmp_path, capture_output=True,
                             text=True, timeout=600)
        assert result.returncode == 0, f"documented command failed: {command}\n{result.stderr[-4000:]}"
        if command == check:
            assert "[ok] expert-parallel: ep 2 of 4 experts" in result.stdout and "ep 2 (its own check" in result.stdout
    assert (tmp_path / "runs" / "moe_tiny" / "expert_load.png").stat().st_size > 0
    assert "layer 3: at step 4 expert" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "runs" / "moe_tiny" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["moe_aux_loss"] > 0 and r["moe_load/3"] >= 1 for r in steps)
    assert all(sum(r["moe_expert_load/3"]) == pytest.approx(1) and len(r["moe_expert_load/3"]) == 8 for r in steps)


@pytest.mark.parametrize("pattern", EXEMPT)
def test_the_exempt_commands_are_still_documented(pattern):
    assert any(pattern in c for c in page_commands(PAGE))
