"""Move checkpoints between tensor-parallel sizes through the canonical (p-independent) state dict.

No per-pair conversion code: every shard of the source is read (and verified), turned into the
canonical state dict with `transformer.model_layout`, and cut again for the target p. Optimizer state
(AdamW's exp_avg / exp_avg_sq have the shapes of their parameters) moves the same way, so a
resumed run continues with its moments. RNG states are per rank and do not survive a change of
layout: a resharded run reseeds from (seed, step).

    read_canonical_checkpoint(step_dir)             -> (run config dict, canonical weights)
    write_canonical_checkpoint(root, run_config, canonical, stages=) -> step_dir at its tp (and pipeline stages)
    reshard_checkpoint(step_dir, out_root, tp, stages) -> step_dir (offline, weights + optimizer, any pp)
    load_resharded(step_dir, model, optimizer)      -> manifest (on resume at another p; every rank)
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import torch
from torch import nn

from ..pipeline.schedules import DEFAULT_SCHEDULE, SCHEDULES, schedule as registered
from ..tensor_parallel.parallel_state import group_rank, group_size, resolve_tp_group
from ..transformer.model_config import ModelConfig
from ..transformer.model_layout import canonical_sources, shard_state_dict, state_dict_keys, unshard_state_dict
from ..transformer.pipeline_stage import PipelineStage
from .checkpoint import raise_unless_all_passed
from .experts import this_ranks_experts, whole_shapes
from .format import (FORMAT, FORMAT_VERSION, CheckpointError, check_shard_shapes, commit, model_file, optim_file,
                     pipeline_stages, read_manifest, read_shard, shard_name, step_dir_name, write_manifest)
from .state_encoding import merged_optimizer_meta, optim_state_dict, optimizer_meta_for, placed_like
from .tensor_io import write_safetensors

_SCALAR_STATE = ("step",)  # per-parameter optimizer scalars: the same on every shard


def _source(step_dir: Path) -> tuple[dict, ModelConfig, int]:
    manifest = read_manifest(step_dir, config_sections=("model", "parallel"))
    return manifest, ModelConfig.from_dict(manifest["config"]["model"]), manifest["tensor_parallel_size"]


def _tp_shard(step_dir: Path, manifest: dict, file_of, r: int, check: bool) -> tuple[dict, dict]:
    """Tensor-parallel rank r's tensors over every pipeline stage (their names are global: the stages' files hold
    disjoint layers, and the tied embedding's two copies are equal), with the first stage's metadata."""
    tensors, metas = {}, []
    for stage in pipeline_stages(manifest):
        part, meta = read_shard(step_dir, manifest, file_of(r, stage))
        if check:
            check_shard_shapes(manifest, r, part, stage)
        tensors.update({k: v for k, v in part.items() if k not in tensors})
        metas.append(meta)
    return tensors, merged_optimizer_meta(metas)


def _canonical_weights(step_dir: Path, manifest: dict, cfg: ModelConfig, p: int) -> dict[str, torch.Tensor]:
    """Every model shard of the checkpoint (every stage's), verified, joined into the canonical state dict."""
    return unshard_state_dict(cfg, [_tp_shard(step_dir, manifest, model_file, r, True)[0] for r in range(p)])


def read_canonical_checkpoint(step_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The run config (as saved: a dict) and full weights of a checkpoint written at any p (every shard verified)."""
    step_dir = Path(step_dir)
    manifest, cfg, p = _source(step_dir)
    return manifest["config"], _canonical_weights(step_dir, manifest, cfg, p)


def _canonical_optimizer(step_dir: Path, manifest: dict, cfg: ModelConfig, p: int):
    """Optimizer state per state key as canonical dicts, plus rank 0's metadata (names, hyper-parameters)."""
    if optim_file(0, pipeline_stages(manifest)[0]) not in manifest["files"]:
        return None, None
    per_rank = [_tp_shard(step_dir, manifest, optim_file, r, False) for r in range(p)]
    by_key: dict[str, list[dict]] = {}
    for tensors, _ in per_rank:
        grouped: dict[str, dict] = {}
        for name, t in tensors.items():
            key, param = name.split("/", 1)
            grouped.setdefault(key, {})[param] = t
        for key, params in grouped.items():
            by_key.setdefault(key, []).append(params)
    canonical = {key: (shards[0] if key in _SCALAR_STATE or key.startswith("__") else
                       unshard_state_dict(cfg, shards)) for key, shards in by_key.items()}
    return canonical, per_rank[0][1]


def _optimizer_shard(cfg: ModelConfig, canonical: dict, keys: list[str], p: int, rank: int) -> dict:
    """Rank `rank`'s optimizer tensors (`<state key>/<param name>`) at tensor-parallel size p."""
    tensors, held = {}, set(keys)
    for key, state in canonical.items():
        if key.startswith("__"):  # group hyper-parameters
            shard = state
        elif key in _SCALAR_STATE:  # per-parameter scalars, for the parameters this rank (its stage) holds
            shard = {name: t for name, t in state.items() if name in held}
        else:
            shard = shard_state_dict(cfg, _names_with_state(cfg, state, keys), state, p, rank)
        tensors.update({f"{key}/{name}": t for name, t in shard.items()})
    return tensors


def _names_with_state(cfg: ModelConfig, canonical_state: dict, keys: list[str]) -> list[str]:
    """Sharded parameter names, in `keys` order, whose canonical sources all have this state."""
    return [k for k in keys if all(n in canonical_state for n in canonical_sources(cfg, k)[1])]


def write_canonical_checkpoint(ckpt_root: str | Path, run_config: dict, canonical: dict[str, torch.Tensor],
                               step: int = 0, *, optimizer: tuple[dict, dict] | None = None,
                               extra: dict | None = None, stages: list[PipelineStage] | None = None) -> Path:
    """Write `ckpt_root/step_XXXXXXX/` sharded at run_config's parallel.tensor_parallel_size, in one process.

    `run_config`: the run config as a dict (`PretrainConfig.to_dict()`), recorded in the manifest.
    `optimizer`: (canonical optimizer state per key, optimizer metadata) as read from another
    checkpoint, or None for weights only. No RNG files: a run resumed from it seeds afresh.
    `stages`: what each pipeline rank holds (`pipeline.layout.rank_stages` of run_config's parallel.pipeline_*),
    one file per stage and tensor-parallel rank; None: the whole model (run_config at pipeline_parallel_size 1).
    """
    p, pp = run_config["parallel"]["tensor_parallel_size"], run_config["parallel"].get("pipeline_parallel_size", 1)
    if len(stages or [PipelineStage()]) != pp:
        raise ValueError(f"parallel.pipeline_parallel_size={pp} needs one PipelineStage per pipeline rank, got "
                         f"{len(stages or [PipelineStage()])}: pass stages=rank_stages(...) of the run config.")
    cfg = ModelConfig.from_dict(run_config["model"])
    root = Path(ckpt_root)
    final = root / step_dir_name(step)
    nonce = secrets.token_hex(6)
    tmp = root / f"{final.name}.tmp-{nonce}"
    tmp.mkdir(parents=True)
    try:
        files, shapes = {}, {}
        for index, stage in enumerate(stages or [PipelineStage()]):
            at = index if pp > 1 else None  # file names without a stage at pp = 1
            for rank in range(p):
                files.update(_write_stage(tmp, cfg, canonical, optimizer, state_dict_keys(cfg, stage), p, rank, at,
                                          shapes))
        write_manifest(tmp, {
            "format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "world_size": p * pp,
            "tensor_parallel_size": p, "data_parallel_size": 1, **({"pipeline_parallel_size": pp} if pp > 1 else {}),
            "torch_version": torch.__version__, "config": run_config, "extra": extra or {}, "model_shapes": shapes,
            "files": files, "resharded": True,
        })
        commit(tmp, final, nonce)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_stage(tmp: Path, cfg: ModelConfig, canonical: dict, optimizer: tuple[dict, dict] | None, keys: list[str],
                 p: int, rank: int, stage: int | None, shapes: dict) -> dict:
    """Tensor-parallel rank `rank`'s model (and optimizer) file of one pipeline stage holding `keys`; its shapes
    go into `shapes`, as a run's manifest lists them. Returns the files' records."""
    weights = {k: v.contiguous() for k, v in shard_state_dict(cfg, keys, canonical, p, rank).items()}
    shapes[shard_name(rank, stage)] = {n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                                       for n, t in weights.items()}
    files = {model_file(rank, stage): write_safetensors(tmp / model_file(rank, stage), weights)}
    if optimizer is not None:
        state, meta = optimizer
        tensors = {k: v.contiguous() for k, v in _optimizer_shard(cfg, state, keys, p, rank).items()}
        files[optim_file(rank, stage)] = write_safetensors(tmp / optim_file(rank, stage), tensors,
                                                           optimizer_meta_for(meta, set(keys)))
    return files


def expert_parallel_keys(size: int | None) -> dict:
    """The parallel keys of a run at expert-parallel size `size` (None: unchanged); ep runs at every zero_stage."""
    return {} if size is None else {"expert_parallel_size": size}


def reshard_checkpoint(step_dir: str | Path, out_root: str | Path, tensor_parallel_size: int,
                       stages: list[PipelineStage] | None = None, expert_parallel_size: int | None = None) -> Path:
    """Offline: the checkpoint at `step_dir` (any layout) rewritten at `tensor_parallel_size` and the pipeline
    `stages` (`pipeline.layout.rank_stages`; None: one stage), optimizer included. The written config's
    parallel.pipeline_* describe those stages (pipeline_layers explicit), so a run resumed there builds them. The
    experts of an MoE are whole in every checkpoint: `expert_parallel_size` changes only the config it records."""
    step_dir = Path(step_dir)
    manifest, cfg, p = _source(step_dir)
    ep = expert_parallel_size
    if ep is not None and (ep < 1 or (cfg.num_experts or 1) % ep or (not cfg.num_experts and ep > 1)):
        raise ValueError(f"expert_parallel_size={ep} must be a positive divisor of model.num_experts="
                         f"{cfg.num_experts} (1 for a dense model).")
    experts = expert_parallel_keys(ep)
    canonical = _canonical_weights(step_dir, manifest, cfg, p)
    optimizer = _canonical_optimizer(step_dir, manifest, cfg, p)
    saved = manifest["config"]
    target = {**saved, "parallel": {**saved["parallel"], "tensor_parallel_size": tensor_parallel_size,
                                     **pipeline_settings(stages or [PipelineStage()], cfg.num_layers,
                                                         saved["parallel"].get("pipeline_schedule", DEFAULT_SCHEDULE)),
                                     **experts}}
    return write_canonical_checkpoint(out_root, target, canonical, manifest["step"],
                                      optimizer=optimizer if optimizer[0] is not None else None,
                                      extra=manifest.get("extra"), stages=stages)


def pipeline_settings(stages: list[PipelineStage], num_layers: int, schedule: str) -> dict:
    """parallel.pipeline_* that build `stages` (one per pipeline rank, v chunks each): layers per virtual stage k
    (chunk k // pp of rank k % pp) explicit; `schedule` kept where it fits v (a chunked schedule needs v >= 2, the
    others v = 1), else the registry's chunked one or its default."""
    pp, v = len(stages), len(stages[0].layer_ranges(num_layers))
    counts = [len(stages[k % pp].layer_ranges(num_layers)[k // pp]) for k in range(pp * v)]
    if registered(schedule).chunked != (v > 1):
        schedule = next(s.name for s in SCHEDULES.values() if s.chunked) if v > 1 else DEFAULT_SCHEDULE
    return {"pipeline_parallel_size": pp, "virtual_pipeline_stages": v,
            "pipeline_layers": counts if pp > 1 else None, "pipeline_schedule": schedule}


@torch.no_grad()
def load_resharded(step_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   tp_group=None) -> dict:
    """Resume from a checkpoint written at another p or world size; call on every rank.

    Each rank reads every source shard (a shared filesystem), verifies it, and keeps its own cut
    at this run's p. As in load_checkpoint, the ranks then agree on the verdict: if any rank failed, every
    rank raises (CheckpointCorruptError when only corruption was found) and nothing was modified.
    A checkpoint without optimizer state (an import) leaves the optimizer fresh. Returns the manifest (with `path`).
    """
    step_dir = Path(step_dir)
    try:
        loaded, failure = _read_resharded(step_dir, model, optimizer, resolve_tp_group(tp_group)), None
    except Exception as e:  # every rank must hear of it, or the others would go on alone
        loaded, failure = None, e
    raise_unless_all_passed(step_dir, failure)
    manifest, weights, optim = loaded
    model.load_state_dict(placed_like(weights, model.state_dict()))
    if optim is not None:
        optimizer.load_state_dict(optim)
    elif optimizer is not None:  # weights only (an import, say): the optimizer starts fresh
        return {**manifest, "path": str(step_dir), "optimizer_restored": False}
    return {**manifest, "path": str(step_dir)}


def _read_resharded(step_dir: Path, model: nn.Module, optimizer, tp_group) -> tuple[dict, dict, dict | None]:
    """Everything that can fail, before anything is modified: the manifest, this rank's weights and optimizer
    state dict at this run's p (None without an optimizer or optimizer state)."""
    manifest, cfg, p_source = _source(step_dir)
    p, rank = group_size(tp_group), group_rank(tp_group)
    canonical = _canonical_weights(step_dir, manifest, cfg, p_source)
    keys = list(model.state_dict())
    weights = shard_state_dict(cfg, keys, canonical, p, rank)
    current = {**model.state_dict(), **whole_shapes(model)}  # experts split over ep: whole in the checkpoint
    differ = [f"{k}: checkpoint {tuple(v.shape)}, model {tuple(current[k].shape)}"
              for k, v in weights.items() if v.shape != current[k].shape]
    if differ:
        raise CheckpointError(f"{step_dir}: resharded weights do not fit this model: " + "; ".join(differ))
    optim = None
    if optimizer is not None:
        state, meta = _canonical_optimizer(step_dir, manifest, cfg, p_source)
        if state is not None:
            live = {name for name, _ in model.named_parameters()}
            optim = optim_state_dict(model, optimizer, _optimizer_shard(cfg, state, keys, p, rank),
                                     optimizer_meta_for(meta, live))
    this_ranks_experts(model, optimizer, optim, weights)
    return manifest, weights, optim
