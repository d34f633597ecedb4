"""Where a run continues from: the newest valid checkpoint (exactly, at the same layout) or any
checkpoint written at another layout (resharded through the canonical state dict)."""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from ..checkpointing.checkpoint import load_checkpoint, load_latest_valid
from ..checkpointing.compatibility import check_same_model, model_shape_config, same_layout
from ..checkpointing.format import CheckpointCorruptError, latest_checkpoint, read_manifest
from ..checkpointing.reshard import load_resharded
from ..tensor_parallel import parallel_state as ps
from ..tensor_parallel.rng import manual_seed
from .config import PretrainConfig


def resume_from_checkpoint(cfg: PretrainConfig, where: str, model: nn.Module, optimizer) -> dict | None:
    """Load the checkpoint to continue from (`auto`: the newest under the run's checkpoints/, falling
    back past corrupt ones; else a step directory). Returns its manifest, or None when there is none."""
    ckpt_root = Path(cfg.logging.run_dir) / "checkpoints"
    target = latest_checkpoint(ckpt_root) if where == "auto" else Path(where)
    if target is None:
        return None
    groups = dict(tp_group=ps.get_tensor_model_parallel_group(), dp_group=ps.get_data_parallel_group())
    expected = {"model": model_shape_config(cfg.model)}
    try:
        saved = read_manifest(target)
    except CheckpointCorruptError:
        if where != "auto":
            raise
        return load_latest_valid(ckpt_root, model, optimizer, expected_config=expected, **groups)
    if same_layout(saved, cfg.parallel.tensor_parallel_size, int(os.environ.get("WORLD_SIZE", "1"))):
        if where == "auto":
            return load_latest_valid(ckpt_root, model, optimizer, expected_config=expected, **groups)
        return load_checkpoint(target, model, optimizer, expected_config=expected, **groups)
    check_same_model(saved, cfg.model, target)
    manifest = load_resharded(target, model, optimizer, tp_group=groups["tp_group"])
    manual_seed(cfg.training.seed + manifest["step"])  # per-rank RNG states do not carry across layouts
    return manifest
