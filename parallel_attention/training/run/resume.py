"""Where a run continues from: the newest checkpoint that loads, exactly (at the same layout) or resharded
through the canonical state dict (at another layout), falling back past corrupt ones on either path."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from torch import nn

from ...checkpointing.checkpoint import load_checkpoint, load_newest_valid, raise_unless_all_passed
from ...checkpointing.compatibility import (check_same_model, describe_layout, layer_runs, model_shape_config,
                                             same_layout, saved_stage_layers, started_before_sampling)
from ...checkpointing.format import CheckpointError, list_checkpoints, read_manifest
from ...checkpointing.reshard import load_resharded
from ...pipeline.layout import StageCosts, rank_stages
from ...tensor_parallel import parallel_state as ps
from ...launch.rank_zero import is_rank_zero
from ...tensor_parallel.rng import manual_seed
from ..config.schema import ConfigError, PretrainConfig

RUN_CONFIG_SECTIONS = ("model", "parallel")  # what a resume reads from a checkpoint's config


class ResumeRefusedError(ConfigError, CheckpointError):
    """No checkpoint this run can continue from (another model, none valid): a config error, exit 2, said once."""


def resume_from_checkpoint(cfg: PretrainConfig, where: str, model: nn.Module, optimizer) -> dict | None:
    """Load the checkpoint to continue from (`auto`: the newest under the run's checkpoints/ that loads, trying
    older ones past corrupt ones, at the same layout or another; else that step directory). Every rank lands on
    the same checkpoint. Returns its manifest, or None when there is none."""
    try:
        if where != "auto":
            return _load(cfg, Path(where), model, optimizer)
        return load_newest_valid(Path(cfg.logging.run_dir) / "checkpoints",
                                 lambda path: _load(cfg, path, model, optimizer))
    except CheckpointError as error:  # the same verdict on every rank (every load ends in a collective one)
        raise ResumeRefusedError(f"cannot resume (checkpoint.resume={where!r}): {error}") from None


def _load(cfg: PretrainConfig, path: Path, model: nn.Module, optimizer) -> dict:
    """`path` exactly at the same layout, else resharded (after which the RNG is reseeded from (seed, step)); the
    manifest of one written at another layout says which in `layout_change` (the run's start line prints it)."""
    groups = dict(tp_group=ps.get_tensor_model_parallel_group(), dp_group=ps.get_data_context_parallel_group())
    saved = _agreed_manifest(path)
    world = ps.get_world_size()
    if same_layout(saved, cfg.parallel.tensor_parallel_size, world, stage_layers(cfg)):
        return load_checkpoint(path, model, optimizer, expected_config={"model": model_shape_config(cfg.model)},
                               **groups)
    check_same_model(saved, cfg.model, path)
    manifest = load_resharded(path, model, optimizer, tp_group=groups["tp_group"])
    manual_seed(cfg.training.seed + manifest["step"])  # per-rank RNG states do not carry across layouts
    change = layout_change(saved, cfg, world)
    return manifest if change is None else {**manifest, "layout_change": change}


def layout_change(saved: dict, cfg: PretrainConfig, world: int) -> str | None:
    """'layout changed: written at <its layout>, resharded to <this run's>' where the two differ (None where they do
    not), with the `parallel.pipeline_layers` that would keep the checkpoint's split where only the balanced split
    moved it (the same tp, world and stages: a checkpoint of an earlier release, whose split weighed the output layer
    as one layer)."""
    tp, layers, saved_layers = cfg.parallel.tensor_parallel_size, stage_layers(cfg), saved_stage_layers(saved)
    written, here = describe_layout(saved["tensor_parallel_size"], saved["world_size"], saved_layers), \
        describe_layout(tp, world, layers)
    if written == here:
        return None
    line = f"layout changed: written at {written}, resharded to {here}"
    same_ranks = (saved["tensor_parallel_size"], saved["world_size"], len(saved_layers)) == (tp, world, len(layers))
    counts = _virtual_stage_counts(saved_layers, cfg.parallel.virtual_pipeline_stages)
    if same_ranks and len(layers) > 1 and cfg.parallel.pipeline_layers is None and counts is not None:
        line += f"; parallel.pipeline_layers={counts} keeps the checkpoint's split"
    return line


def _virtual_stage_counts(stage_layers: list[list[int]], v: int) -> list[int] | None:
    """Layers per virtual stage (chunk k // pp of rank k % pp) of ranks holding `stage_layers`, each rank's v chunks
    its contiguous runs; None where a rank holds another number of runs."""
    runs = [layer_runs(layers) for layers in stage_layers]
    if any(len(r) != v for r in runs):
        return None
    pp = len(stage_layers)
    return [len(runs[k % pp][k // pp]) for k in range(pp * v)]


def stage_layers(cfg: PretrainConfig) -> list[list[int]]:
    """The layers (global indices) each pipeline rank of this run holds, in rank order."""
    m, par = cfg.model, cfg.parallel
    stages = rank_stages(m.num_layers, par.pipeline_parallel_size, par.virtual_pipeline_stages, par.pipeline_layers,
                         StageCosts.of(m, cfg.data.seq_len))
    return [[i for r in stage.layer_ranges(m.num_layers) for i in r] for stage in stages]


def _agreed_manifest(path: Path) -> dict:
    """The manifest, read on every rank; every rank raises if any rank could not read it (same decision)."""
    try:
        saved, failure = read_manifest(path, config_sections=RUN_CONFIG_SECTIONS), None
    except CheckpointError as e:
        saved, failure = None, e
    raise_unless_all_passed(path, failure)
    return saved


def resume_manifest(cfg: PretrainConfig, where: str) -> dict | None:
    """The manifest of the checkpoint a resume from `where` would read (`auto`: the newest under the run's
    checkpoints/), without loading it: None for `none`, no checkpoint, or one that cannot be read."""
    if where == "auto":
        found = list_checkpoints(Path(cfg.logging.run_dir) / "checkpoints")
        where = str(found[-1]) if found else "none"
    if where == "none":
        return None
    try:
        manifest = read_manifest(where, verify=False)
    except CheckpointError:
        return None
    return manifest if isinstance(manifest, dict) and "extra" in manifest and "step" in manifest else None


def keep_previous_sampling(cfg: PretrainConfig, where: str) -> PretrainConfig:
    """The config the run trains with: `cfg` itself, or, for a run started before `data.sampling` existed (it drew
    random windows), a copy with data.sampling=random_windows, so that resumed it sees the batches it would have
    seen. The checkpoint it resumes from (`auto`: the newest under the run's checkpoints/) then holds a config whose
    data section has no `sampling` (`started_before_sampling`). `cfg` is never changed; every rank reads the same
    manifest, so every rank chooses alike."""
    if where == "none":
        return cfg
    if where == "auto":
        found = list_checkpoints(Path(cfg.logging.run_dir) / "checkpoints")
        if not found:
            return cfg  # a fresh start: the configured sampling
        where = str(found[-1])
    try:
        saved = read_manifest(where, verify=False)["config"]
    except (CheckpointError, KeyError, TypeError):
        return cfg  # nothing readable: the resume itself says what is wrong
    if not started_before_sampling(saved) or cfg.data.sampling == "random_windows":
        return cfg
    if is_rank_zero():
        print("data.sampling: random_windows (this run was started before epochs existed and keeps its "
              "batches; start a new logging.run_dir for data.sampling=epochs)", file=sys.stderr, flush=True)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, sampling="random_windows"))
