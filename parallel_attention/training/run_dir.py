"""The run directory, made and proved writable before any training step.

An unwritable `logging.run_dir` (read-only filesystem or permissions, a file in the way of the path)
would otherwise surface only at the first checkpoint, after the time spent training up to it. Global
rank 0 creates the directory and its checkpoints/, writes and removes a probe file in each and writes
config.yaml; every rank hears the verdict and refuses to start with the same named error.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..tensor_parallel import parallel_state as ps
from ..tensor_parallel.collectives import broadcast_object
from .config import ConfigError, PretrainConfig, save_config


class RunDirError(ConfigError):
    """`logging.run_dir` cannot be created or written."""


def prepare_run_dir(cfg: PretrainConfig) -> None:
    """Rank 0 makes `<run_dir>` and `<run_dir>/checkpoints` and proves them writable, then writes config.yaml;
    on failure every rank raises RunDirError naming the directory and the cause."""
    error = broadcast_object(_make_writable(cfg) if ps.get_global_rank() == 0 else None)
    if error is not None:
        raise RunDirError(f"logging.run_dir={cfg.logging.run_dir!r} is not writable ({error}): nothing could be "
                          "checkpointed. Point --logging.run_dir= at a writable directory or fix its permissions.")


def _make_writable(cfg: PretrainConfig) -> str | None:
    """Rank 0: create and probe the directories, write config.yaml; the error as text, None when all is well."""
    run_dir = Path(cfg.logging.run_dir)
    try:
        for directory in (run_dir, run_dir / "checkpoints"):
            directory.mkdir(parents=True, exist_ok=True)
            handle, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
            os.close(handle)
            os.remove(probe)
        save_config(cfg, run_dir / "config.yaml")
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None
