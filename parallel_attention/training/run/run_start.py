"""Where a run starts, said in one line by rank 0: from a checkpoint, from step 0 (and why), or not at all
because the run has already reached `training.max_steps` (a finished run launched again trains nothing and
rewrites nothing: its metrics, plot, config.yaml and tokenizer stay as they were)."""

from __future__ import annotations

import sys
from pathlib import Path

from ...launch.rank_zero import is_rank_zero
from ..config.schema import PretrainConfig


def finished(cfg: PretrainConfig, step: int) -> bool:
    """Whether a run at `step` has nothing left to train."""
    return step >= cfg.training.max_steps


def start_line(cfg: PretrainConfig, where: str, manifest: dict | None) -> str:
    """The line for a run that resumed from `manifest` (None: none found, or `where` is `none`)."""
    run_dir, max_steps = cfg.logging.run_dir, cfg.training.max_steps
    if manifest is None:
        why = "checkpoint.resume=none" if where == "none" else f"no checkpoint in {Path(run_dir) / 'checkpoints'}"
        return f"starting at step 0 ({why})"
    step = manifest["step"]
    if not finished(cfg, step):
        change = f" ({manifest['layout_change']})" if "layout_change" in manifest else ""
        return f"resumed from {manifest['path']} at step {step}{change}"
    at = "= training.max_steps" if step == max_steps else f"past training.max_steps={max_steps}"
    return f"nothing to do: {run_dir} is at step {step} {at}; raise it to train on, or use another logging.run_dir"


def say_start(cfg: PretrainConfig, where: str, manifest: dict | None) -> bool:
    """Rank 0 says where the run starts; returns whether there is anything to train (the same on every rank)."""
    if is_rank_zero():
        print(start_line(cfg, where, manifest), file=sys.stderr, flush=True)
    return manifest is None or not finished(cfg, manifest["step"])
