"""Whether a checkpoint fits this run: the one compatibility check, used by every load path.

A checkpoint fits when it holds the same model (every setting that shapes the weights; runtime
settings such as dropout may change across a resume), and, for an exact resume, the same layout
(tensor-parallel size and world size: RNG states and data positions are saved per rank).
"""

from __future__ import annotations

import dataclasses
import json

from ..transformer.model_config import ModelConfig, migrate_renamed_keys
from .format import CheckpointError

# settings that change how the model runs, not what its weights are
RUNTIME_MODEL_KEYS = frozenset({"hidden_dropout", "attention_dropout", "dropout_rng", "recompute_activations",
                                "recompute_granularity", "attention_kernel", "compile"})


def model_shape_config(model: ModelConfig) -> dict:
    """The model settings a checkpoint must match (JSON-normalised, as a manifest stores them)."""
    shaping = {k: v for k, v in dataclasses.asdict(model).items() if k not in RUNTIME_MODEL_KEYS}
    return json.loads(json.dumps(shaping))


def check_same_model(manifest: dict, model: ModelConfig, where) -> None:
    """Refuse a checkpoint of another model, naming each differing `model.*` setting."""
    saved = model_shape_config(ModelConfig.from_dict(manifest["config"]["model"]))  # 0.1.0 key names too
    wanted = model_shape_config(model)
    differs = [f"model.{k}: checkpoint {saved.get(k)!r}, this run {v!r}" for k, v in wanted.items()
               if saved.get(k) != v]
    if differs:
        raise CheckpointError(f"{where} holds another model: " + "; ".join(differs))


def same_layout(manifest: dict, tensor_parallel_size: int, world_size: int) -> bool:
    """Whether an exact resume is possible (else the checkpoint is resharded on load)."""
    return (manifest["tensor_parallel_size"], manifest["world_size"]) == (tensor_parallel_size, world_size) \
        and not manifest.get("resharded")


def check_layout(manifest: dict, world_size: int, tp_size: int) -> None:
    """Refuse an exact load at another layout, saying why and what to do."""
    if manifest["tensor_parallel_size"] != tp_size:
        raise CheckpointError(
            f"this checkpoint was written at tensor_parallel_size={manifest['tensor_parallel_size']}, "
            f"this run uses {tp_size} (an exact load needs the same size; resharding does not): resume through "
            "load_resharded (pretrain.py does), or reshard it with scripts/reshard_checkpoint.py.")
    if manifest["world_size"] != world_size:
        raise CheckpointError(
            f"this checkpoint was written by world_size={manifest['world_size']} "
            f"(data_parallel_size={manifest['data_parallel_size']}), this run has world_size={world_size} "
            f"(data_parallel_size={world_size // tp_size}): every rank's RNG state and data position are "
            "saved per rank, so resume with the same number of ranks.")


def flatten_dict(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: nested config dicts compared key by dotted key."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_dict(value, name + "."))
        else:
            flat[name] = value
    return flat


def check_config(manifest: dict, expected_config: dict | None) -> None:
    """Refuse a checkpoint whose saved config differs from `expected_config` (nested dicts compare by
    dotted key; keys absent from `expected_config` are not checked)."""
    if expected_config is None:
        return
    saved_config = dict(manifest.get("config", {}))
    if "model" in saved_config:  # keys renamed since it was written, read under today's names; not
        # ModelConfig.from_dict: callers may check any dict, and absent keys must stay absent
        saved_config["model"] = migrate_renamed_keys(ModelConfig, saved_config["model"], "model", warn=False)
    saved = flatten_dict(saved_config)
    wanted = flatten_dict(json.loads(json.dumps(expected_config)))  # JSON turned tuples into lists
    missing = object()
    diffs = [f"{key}: checkpoint {saved.get(key, '<absent>')!r}, run {value!r}"
             for key, value in wanted.items() if saved.get(key, missing) != value]
    if diffs:
        raise CheckpointError("the checkpoint's config differs from this run's: " + "; ".join(diffs) + ".")
