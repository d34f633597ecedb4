"""Pretrain a GPT model from a YAML config under torchrun.

    torchrun --standalone --nproc-per-node 2 scripts/pretrain.py --config configs/gpt_tiny.yaml \
        [--resume] [--section.key=value ...]

The config is read and validated before any process group exists, so a typo or an impossible
layout fails at once with a message that names the value and the fix: one `config error: ...` line,
said once (by rank 0) and first, and every rank exits with status 2. torchrun itself then prints its
report, whose root cause (rank 0) repeats the line, and exits 1: its status for any failed worker.
"""

from __future__ import annotations

import argparse
import sys

from parallel_attention import load_config
from parallel_attention.tensor_parallel import parallel_state as ps
from parallel_attention.launch.launcher_watch import stop_with_launcher
from parallel_attention.launch.rank_zero import is_rank_zero
from parallel_attention.launch.report_once import record_errors, report_from_rank_0
from parallel_attention.launch.warning_lines import one_line_warnings
from parallel_attention.training import ConfigError, train
from parallel_attention.training.config.loading import parse_with_overrides
from parallel_attention.training.guards.rank_checks import GuardError


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/gpt_tiny.yaml", help="YAML config (default: %(default)s)")
    parser.add_argument("--resume", nargs="?", const="auto", default=None,
                        help="continue from the newest complete checkpoint (or from the step directory given); "
                             "default: the config's checkpoint.resume (auto: the newest complete checkpoint, if any)")
    return parse_with_overrides(parser, argv)


@record_errors  # an error no refusal caught: torchrun's root cause is its one line
def main(argv: list[str]) -> int:
    stop_with_launcher()  # under torchrun: a worker whose launcher dies stops at once
    one_line_warnings()
    args, overrides = parse_args(argv)
    try:
        cfg = load_config(args.config, overrides)
    except (ValueError, OSError) as error:  # the same on every rank (each reads the same file): said once
        report_from_rank_0(f"config error: {error}")
        return 2
    try:
        return _train(cfg, args.resume)
    finally:
        ps.shutdown_distributed()  # on every way out: a live gloo group at exit can abort with SIGABRT


def _train(cfg, resume: str | None) -> int:
    """Train, report, and return the exit status: 2 for a config error, 1 for a stop all ranks agreed on."""
    try:
        result = train(cfg, resume=resume)  # validates the config before any process group exists
    except ConfigError as error:  # validation, the run directory, the ranks' agreement: the same on every rank
        report_from_rank_0(f"config error: {error}")
        return 2
    except GuardError as error:  # agreed on every rank (divergence, replica mismatch): said once
        report_from_rank_0(f"run stopped: {type(error).__name__}: {error}", exit_status=1)
        return 1
    if not result.losses and result.last_step >= cfg.training.max_steps:
        return 0  # already finished: the trainer said "nothing to do" and trained nothing
    if is_rank_zero():
        final = result.val_losses.get(result.last_step)
        print(f"finished at step {result.last_step}" + (f", validation loss {final:.4f}" if final else "")
              + (f" (stopped by {result.stopped_by_signal}; resume with --resume)" if result.stopped_by_signal else "")
              + f"; outputs in {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
