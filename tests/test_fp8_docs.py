"""Every command of docs/fp8.md runs as written where this machine can run it: the FP8 pretraining launch (the
tiny model shrunk, 2 steps, on the session's prepared data: overrides appended, the later wins), and the GPU step,
which needs CUDA, is checked to start (its imports load) as gpu_check.sh --dry-run checks it."""

from __future__ import annotations

import shlex
import sys

from launch import ROOT, torchrun, train_losses
from test_data_docs import documented_commands
from tiny_run import tiny_args

sys.path.insert(0, str(ROOT / "benchmarks"))
from _gpu_check_plumbing import problems  # noqa: E402

PAGE = ROOT / "docs" / "fp8.md"


def test_every_command_of_the_fp8_page_runs(shared_data, tmp_path):
    commands = documented_commands(PAGE)
    assert len(commands) == 2
    for command in commands:
        args = shlex.split(command)
        if args[0] == "torchrun":
            nproc = int(args[args.index("--nproc-per-node") + 1])
            script = args.index("scripts/pretrain.py")
            run_dir = tmp_path / "run"
            torchrun("pretrain.py", nproc, args[script + 1:] + tiny_args(shared_data, run_dir, 2, 2)[2:])
            assert sorted(train_losses(run_dir)) == [1, 2]
        else:
            assert args[:2] == ["python", "benchmarks/_gpu_check_fp8.py"], command
            assert problems([sys.executable, str(ROOT / args[1])]) == []
