"""The collective save/load protocol: sharded, atomic, verified checkpoints of a p x dp run.

Model and optimizer state are sharded across the p tensor-parallel ranks and replicated across the
dp data-parallel ranks, so the data-parallel rank 0 of each tensor-parallel group writes its shard;
every global rank writes its own RNG states. Optimizer state sharded across the data-parallel ranks
(ZeRO-1) is first consolidated in memory on that writer, and parameters and optimizer state sharded
by FSDP2 (zero_stage 3) are gathered over the data-parallel group, so the files do not depend on dp or on
sharding. This module owns who writes and reads what, and how
the ranks agree; the files and the commit are `format`, their contents `state_encoding`, the bytes
`tensor_io`, and whether a checkpoint fits this run `compatibility`.

    save:  rank 0 picks a nonce -> every rank writes + fsyncs its files into step_N.tmp-<nonce>/
           -> all_gather of sizes/sha256 -> rank 0 writes manifest.json, renames to step_N/, prunes
           -> broadcast of the outcome (no rank returns before the checkpoint is complete)
    load:  every rank verifies the files it reads and checks names/shapes -> all_gather of the
           verdicts -> only if every rank passed does any rank touch its model, optimizer, RNG

Collectives (`broadcast_object`, `all_gather_objects`) use the default group and are issued only
when torch.distributed is initialised; otherwise this is a world of one.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..launch.rank_zero import is_rank_zero
from ..tensor_parallel.collectives import all_gather_objects, broadcast_object, raise_together
from ..tensor_parallel.parallel_state import (ProcessGroup, get_data_parallel_group, get_global_rank,
                                              get_pipeline_parallel_group, group_rank, group_size, is_distributed,
                                              model_parallel_is_initialized, resolve_tp_group)
from .compatibility import check_config, check_layout
from .format import (FORMAT, FORMAT_VERSION, MANIFEST, CheckpointCorruptError, CheckpointError, check_shard_shapes,
                     commit, latest_checkpoint, list_checkpoints, list_incomplete, model_file, optim_file, prune,
                     read_manifest, read_shard, rng_file, shard_name, step_dir_name, verify_file, write_manifest)
from .experts import this_ranks_experts, whole_shapes, whole_state
from .state_encoding import optim_state_dict, optim_tensors, placed_like, rng_tensors, set_rng
from .tensor_io import cpu_tensors, read_safetensors, write_safetensors

__all__ = ["CheckpointCorruptError", "CheckpointError", "latest_checkpoint", "list_checkpoints", "load_checkpoint",
           "load_latest_valid", "load_newest_valid", "raise_unless_all_passed", "resolve_step_dir", "save_checkpoint"]


@dataclass(frozen=True)
class _Placement:
    rank: int
    world: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    stage: int | None = None  # the pipeline stage (None at pp = 1: file names without one)
    pp_size: int = 1

    @staticmethod
    def of(tp_group: ProcessGroup | None, dp_group: ProcessGroup | None) -> "_Placement":
        tp_group = resolve_tp_group(tp_group)
        dp_group = dp_group if dp_group is not None else get_data_parallel_group()
        pp_group = get_pipeline_parallel_group() if model_parallel_is_initialized() else None
        rank, world = get_global_rank(), dist.get_world_size() if is_distributed() else 1
        tp_size, dp_size, pp_size = group_size(tp_group), group_size(dp_group), group_size(pp_group)
        if tp_size * dp_size * pp_size != world:
            raise ValueError(f"tensor-parallel size {tp_size} x data-parallel size {dp_size} x pipeline-parallel "
                             f"size {pp_size} != world size {world}: pass the tp_group/dp_group the model was "
                             "built with.")
        stage = group_rank(pp_group) if pp_size > 1 else None
        return _Placement(rank, world, group_rank(tp_group), tp_size, group_rank(dp_group), stage, pp_size)


# ---------------------------------------------------------------- save


def _write(directory: Path, name: str, tensors: dict, meta: dict | None = None) -> dict:
    return {name: write_safetensors(directory / name, tensors, meta)}


def _write_shards(tmp: Path, at: _Placement, model: nn.Module, weights: dict, optimizer, packed: dict | None) -> dict:
    files, shapes = {}, None
    if at.dp_rank == 0:  # model and (consolidated) optimizer are the same on every data-parallel rank
        tensors = cpu_tensors(weights)
        files.update(_write(tmp, model_file(at.tp_rank, at.stage), tensors))
        shapes = {n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for n, t in tensors.items()}
        if optimizer is not None:
            files.update(_write(tmp, optim_file(at.tp_rank, at.stage), *optim_tensors(model, optimizer, packed)))
    files.update(_write(tmp, rng_file(at.rank), *rng_tensors()))
    return {"files": files, "shard": shard_name(at.tp_rank, at.stage), "shapes": shapes}


def _manifest(step: int, at: _Placement, config: dict, extra: dict, reports: list[dict]) -> dict:
    writers = sorted(r["shard"] for r in reports if r["shapes"] is not None)
    stages = [None] if at.pp_size == 1 else list(range(at.pp_size))
    expected = sorted(shard_name(r, s) for r in range(at.tp_size) for s in stages)
    if writers != expected:
        raise RuntimeError(f"expected one writer per tensor-parallel rank and pipeline stage {expected}, got "
                           f"{writers}: are tp_group and dp_group the groups the run uses?")
    pipeline = {"pipeline_parallel_size": at.pp_size} if at.pp_size > 1 else {}
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "world_size": at.world,
        "tensor_parallel_size": at.tp_size, "data_parallel_size": at.world // (at.tp_size * at.pp_size), **pipeline,
        "torch_version": torch.__version__, "config": config, "extra": extra,
        "model_shapes": {r["shard"]: r["shapes"] for r in reports if r["shapes"] is not None},
        "files": {name: record for r in reports for name, record in r["files"].items()},
    }


def save_checkpoint(ckpt_root: str | os.PathLike, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    *, config: dict, extra: dict, keep_last: int | None,
                    tp_group: ProcessGroup | None = None, dp_group: ProcessGroup | None = None) -> Path:
    """Write `<ckpt_root>/step_<step>/` atomically; call on every rank. Returns the checkpoint path.

    `config` and `extra` (data position, scheduler, scaler, ...) must be JSON-able; rank 0's are kept.
    `keep_last` complete checkpoints remain afterwards (None keeps all).
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative integer.")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r} must be a positive integer or None (keep all).")
    config, extra = json.loads(json.dumps(config)), json.loads(json.dumps(extra))  # JSON-able, checked up front
    at = _Placement.of(tp_group, dp_group)
    root = Path(ckpt_root)
    final = root / step_dir_name(step)
    nonce, error = broadcast_object(_make_temporary(final) if at.rank == 0 else None)
    if error is not None:
        raise CheckpointError(f"saving step {step}: cannot create a directory under {root}: {error}")
    tmp = root / f"{final.name}.tmp-{nonce}"
    weights, packed = whole_state(model, optimizer, at.dp_rank == 0)  # collectives: outside the per-rank try below
    try:
        report = {"ok": True, **_write_shards(tmp, at, model, weights, optimizer, packed)}
    except Exception as e:  # reported to every rank below, so no rank is left waiting in a collective
        report, local_failure = {"ok": False, "error": f"rank {at.rank}: {type(e).__name__}: {e}"}, e
    reports = all_gather_objects(report)
    outcome = _commit(step, at, config, extra, reports, tmp, final, nonce, keep_last) if at.rank == 0 else None
    outcome = broadcast_object(outcome)  # doubles as the barrier: nobody returns before the commit
    if outcome is not None:
        raise CheckpointError(f"saving step {step} to {final} failed: {outcome}") from (
            local_failure if not report["ok"] else None)
    return final


def _make_temporary(final: Path) -> tuple[str, str | None]:
    """Rank 0: a fresh nonce and its empty step_N.tmp-<nonce>/ (or the error), before anyone writes."""
    nonce = secrets.token_hex(6)
    try:
        (final.parent / f"{final.name}.tmp-{nonce}").mkdir(parents=True)
    except OSError as e:
        return nonce, str(e)
    return nonce, None


def _commit(step, at, config, extra, reports, tmp: Path, final: Path, nonce: str, keep_last) -> str | None:
    """Rank 0: manifest, rename into place, retention. Returns an error message, None on success."""
    errors = [r["error"] for r in reports if not r["ok"]]
    try:
        if errors:
            raise CheckpointError("; ".join(errors))
        write_manifest(tmp, _manifest(step, at, config, extra, reports))
        commit(tmp, final, nonce)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return f"{type(e).__name__}: {e}" if not errors else str(e)
    try:  # the checkpoint is complete: failing to delete old ones must not fail the save
        prune(final.parent, keep_last, final, nonce)
    except OSError as e:
        warnings.warn(f"checkpoint {final} saved, but removing old checkpoints failed: {e}", RuntimeWarning)
    return None


# ---------------------------------------------------------------- load


def _read_and_check(path: Path, at: _Placement, model: nn.Module, optimizer, expected_config) -> dict:
    """Everything that can fail, done before anything is modified: verified, checked, ready to apply."""
    manifest = read_manifest(path, config_sections=tuple(expected_config or ()))
    check_layout(manifest, at.world, at.tp_size, at.pp_size)
    check_config(manifest, expected_config)
    weights, _ = read_shard(path, manifest, model_file(at.tp_rank, at.stage))
    check_shard_shapes(manifest, at.tp_rank, weights, at.stage)
    current = {**model.state_dict(), **whole_shapes(model)}
    missing, unexpected = sorted(set(current) - set(weights)), sorted(set(weights) - set(current))
    if missing or unexpected:
        raise CheckpointError(f"{model_file(at.tp_rank, at.stage)}: parameters in the model but not in the checkpoint "
                              f"{missing}; in the checkpoint but not in the model {unexpected}.")
    differ = [f"parameter {name!r}: checkpoint shape {tuple(saved.shape)} {saved.dtype}, "
              f"model shape {tuple(current[name].shape)} {current[name].dtype}"
              for name, saved in weights.items()
              if saved.shape != current[name].shape or saved.dtype != current[name].dtype]
    if differ:
        raise CheckpointError(f"{model_file(at.tp_rank, at.stage)}: " + "; ".join(differ) + ".")
    loaded = {"manifest": manifest, "weights": weights, "optim": None}
    if optimizer is not None:
        if optim_file(at.tp_rank, at.stage) not in manifest["files"]:
            raise CheckpointError(f"{path} holds no optimizer state (saved with optimizer=None): "
                                  "load it with optimizer=None.")
        tensors, meta = read_shard(path, manifest, optim_file(at.tp_rank, at.stage))
        loaded["optim"] = optim_state_dict(model, optimizer, tensors, meta)
    loaded["rng"] = read_safetensors(verify_file(path, manifest, rng_file(at.rank)))
    this_ranks_experts(model, optimizer, loaded["optim"], weights)
    return loaded


def raise_unless_all_passed(path: Path, failure: Exception | None) -> None:
    """The collective verdict of a load: every rank passes its own `failure` (None if it is ready), and every
    rank raises if any rank failed (CheckpointCorruptError if only corruption was found), so that all ranks
    take the same decision."""
    verdict = None if failure is None else (isinstance(failure, CheckpointCorruptError),
                                            str(failure) if isinstance(failure, CheckpointError) else repr(failure))
    raise_together(verdict, lambda verdicts: _refusal(path, verdicts), cause=failure)


def _refusal(path: Path, verdicts: dict[int, tuple[bool, str]]) -> CheckpointError:
    """The error every rank raises for the ranks' (corrupt?, message) verdicts, ranks with one message together."""
    ranks_by_message = {m: [str(r) for r, (_, said) in verdicts.items() if said == m] for _, m in verdicts.values()}
    text = "; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(r)}: {m}" for m, r in ranks_by_message.items())
    cls = CheckpointCorruptError if all(corrupt for corrupt, _ in verdicts.values()) else CheckpointError
    return cls(f"cannot load {path}: {text}")


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    expected_config: dict | None = None,
                    tp_group: ProcessGroup | None = None, dp_group: ProcessGroup | None = None) -> dict:
    """Restore model, optimizer and this rank's RNG states from `path`; call on every rank.

    Returns the manifest (its `extra`, `config`, `step`; `path` added). Raises CheckpointError on every
    rank if any rank finds a problem, and then nothing has been modified on any rank.
    `expected_config`: the model-shaping settings that must equal those saved (nested dicts compare by
    dotted key; keys absent here are not checked).
    """
    path, at = Path(path), _Placement.of(tp_group, dp_group)
    try:
        loaded, failure = _read_and_check(path, at, model, optimizer, expected_config), None
    except Exception as e:  # every rank must hear of it, or the others would go on alone
        loaded, failure = None, e
    raise_unless_all_passed(path, failure)
    model.load_state_dict(placed_like(loaded["weights"], model.state_dict()))
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optim"])
    set_rng(*loaded["rng"])
    return {**loaded["manifest"], "path": str(path)}


def load_newest_valid(ckpt_root: str | os.PathLike, attempt: Callable[[Path], dict]) -> dict | None:
    """`attempt(path)` on the complete checkpoints under `ckpt_root`, newest first, falling back past those that
    raise CheckpointCorruptError; returns the first result, None when there is no checkpoint at all.

    Rank 0's listing is used by every rank and `attempt` must end in a collective verdict
    (`raise_unless_all_passed`, as load_checkpoint and load_resharded do), so all ranks land on the same step.
    Any other error is raised at once: an older checkpoint would not fix it.
    """
    candidates = broadcast_object([str(p) for p in list_checkpoints(ckpt_root)])
    if is_rank_zero():
        for path in list_incomplete(ckpt_root):
            warnings.warn(f"skipping incomplete checkpoint {path}: it holds no {MANIFEST} (a save that never "
                          "finished, or another writer's); it is never loaded. Delete it once you have checked it.",
                          RuntimeWarning, stacklevel=3)
    failures = []
    for path in reversed(candidates):
        try:
            return attempt(Path(path))
        except CheckpointCorruptError as e:
            failures.append(str(e))
            if is_rank_zero():
                warnings.warn(f"skipping corrupt checkpoint: {e}", RuntimeWarning, stacklevel=3)
    if failures:
        raise CheckpointCorruptError(f"no valid checkpoint under {ckpt_root}: " + " | ".join(failures))
    return None


def load_latest_valid(ckpt_root: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                      *, expected_config: dict | None = None,
                      tp_group: ProcessGroup | None = None, dp_group: ProcessGroup | None = None) -> dict | None:
    """Load the newest complete checkpoint that verifies, exactly (`load_checkpoint`), falling back past
    corrupt ones (`load_newest_valid`). Incompatibility (tensor-parallel size, config, shapes) is raised at once."""
    return load_newest_valid(ckpt_root, lambda path: load_checkpoint(
        path, model, optimizer, expected_config=expected_config, tp_group=tp_group, dp_group=dp_group))


def resolve_step_dir(path: str | os.PathLike) -> Path:
    """A step directory as given, or the newest complete checkpoint of a run (or its checkpoints/) directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory (relative to {Path.cwd()}): pass a run directory, which "
                              "pretraining writes at logging.run_dir, or one of its checkpoints/step_XXXXXXX.")
    if (path / MANIFEST).exists():
        return path
    for root in (path / "checkpoints", path):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    raise CheckpointError(f"no complete checkpoint under {path}: pass a run directory or a step_XXXXXXX directory.")
