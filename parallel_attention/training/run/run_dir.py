"""The run directory: held by one run, proved writable before any training step, its config written last.

Global rank 0 first takes the directory's lock (`run_lock`): a second run on a live directory is refused
before it writes anything. Then it creates the directory and its checkpoints/, writes and removes a probe
file in each (an unwritable `logging.run_dir` would otherwise surface only at the first checkpoint, after
the time spent training up to it) and removes the temporaries a dead run left there. Every rank hears the
verdict and refuses to start with the same named error. config.yaml is written only once the run has
resumed (`write_run_config`): a refused resume leaves the old one beside the checkpoints it describes.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from ...checkpointing.format import list_temporaries
from ...checkpointing.reshard import expert_parallel_keys
from ...checkpointing.tensor_io import write_atomic
from ...launch.rank_zero import is_rank_zero
from ...tensor_parallel.collectives import broadcast_object
from ..config.schema import ConfigError, PretrainConfig, recorded_config
from .run_lock import RunDirInUseError, RunDirLock

_HELD: dict[str, RunDirLock] = {}  # run dirs this process holds: a notebook or test that builds twice keeps one


class RunDirError(ConfigError):
    """`logging.run_dir` cannot be created or written."""


def lock_run_dir(cfg: PretrainConfig) -> None:
    """Rank 0 takes the run directory's lock; every rank raises RunDirInUseError if another run holds it."""
    error = broadcast_object(_acquire(Path(cfg.logging.run_dir)) if is_rank_zero() else None)
    if error is not None:
        raise RunDirInUseError(error)


def _acquire(run_dir: Path) -> str | None:
    key = str(run_dir.resolve())
    if key in _HELD:
        return None
    lock = RunDirLock(run_dir)
    try:
        lock.acquire()
    except RunDirInUseError as error:
        return str(error)
    except OSError:  # cannot even create it: prepare_run_dir's probe names the cause
        return None
    _HELD[key] = lock
    return None


def ensure_run_dir_held(cfg: PretrainConfig) -> None:
    """Rank 0, before it writes a step's outputs: raise if another run took the lease over."""
    lock = _HELD.get(str(Path(cfg.logging.run_dir).resolve()))
    if lock is not None:
        lock.ensure_held()


def release_run_dir(cfg: PretrainConfig) -> None:
    lock = _HELD.pop(str(Path(cfg.logging.run_dir).resolve()), None)
    if lock is not None:
        lock.release()


def prepare_run_dir(cfg: PretrainConfig) -> None:
    """Rank 0 makes `<run_dir>` and `<run_dir>/checkpoints`, proves them writable and removes a dead run's
    temporaries; on failure every rank raises RunDirError naming the directory and the cause."""
    error = broadcast_object(_make_writable(cfg) if is_rank_zero() else None)
    if error is not None:
        raise RunDirError(f"logging.run_dir={cfg.logging.run_dir!r} is not writable ({error}): nothing could be "
                          "checkpointed. Point --logging.run_dir= at a writable directory or fix its permissions.")


def _make_writable(cfg: PretrainConfig) -> str | None:
    """Rank 0: create and probe the directories, clear leftovers; the error as text, None when all is well."""
    run_dir = Path(cfg.logging.run_dir)
    try:
        for directory in (run_dir, run_dir / "checkpoints"):
            directory.mkdir(parents=True, exist_ok=True)
            handle, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
            os.close(handle)
            os.remove(probe)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    remove_leftovers(run_dir)
    return None


def _size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def remove_leftovers(run_dir: Path) -> None:
    """The lock holder deletes what a killed run left half-written: `step_N.tmp-*` checkpoint directories and
    metrics.jsonl's rewrite. Nobody else can be writing them, since we hold the lock. Says what it removed."""
    leftovers = [*list_temporaries(run_dir / "checkpoints"), *run_dir.glob("metrics.jsonl.tmp")]
    if not leftovers:
        return
    sizes = sum(_size_bytes(p) for p in leftovers)
    for path in leftovers:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    names = ", ".join(p.name for p in leftovers)
    print(f"removed {len(leftovers)} leftover temporar{'y' if len(leftovers) == 1 else 'ies'} of an earlier run "
          f"({sizes / 1e6:.1f} MB) from {run_dir}: {names}", file=sys.stderr, flush=True)


def write_run_config(cfg: PretrainConfig) -> None:
    """Rank 0 writes config.yaml (atomically), once the run has resumed or started fresh: a refused resume
    leaves the old one."""
    if is_rank_zero():
        text = yaml.safe_dump(recorded_config(cfg.to_dict()), sort_keys=False)
        write_atomic(Path(cfg.logging.run_dir) / "config.yaml", [text.encode("utf-8")])


def carry_model_files(source_run: Path, out_run: Path, tensor_parallel_size: int,
                      expert_parallel_size: int | None = None) -> list[str]:
    """Give a resharded copy of a run (OUT/checkpoints only) the run's config.yaml (at its new tensor-parallel size,
    and expert-parallel size where given, and run directory) and tokenizer/, so that generation and a resume there
    never depend on the source run. Returns what was written (nothing the source run lacks)."""
    written = []
    out_run.mkdir(parents=True, exist_ok=True)
    config = source_run / "config.yaml"
    if config.is_file():
        data = yaml.safe_load(config.read_text(encoding="utf-8"))
        data.setdefault("parallel", {})["tensor_parallel_size"] = tensor_parallel_size
        data["parallel"].update(expert_parallel_keys(expert_parallel_size))
        data.setdefault("logging", {})["run_dir"] = str(out_run)
        write_atomic(out_run / "config.yaml", [yaml.safe_dump(data, sort_keys=False).encode("utf-8")])
        written.append("config.yaml")
    tokenizer = source_run / "tokenizer"
    for path in sorted(tokenizer.iterdir()) if tokenizer.is_dir() else []:
        (out_run / "tokenizer").mkdir(parents=True, exist_ok=True)
        write_atomic(out_run / "tokenizer" / path.name, [path.read_bytes()])
        written.append(f"tokenizer/{path.name}")
    return written
