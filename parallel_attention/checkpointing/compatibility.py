"""What earlier releases wrote, and whether a checkpoint fits this run: the one place that knows old formats.

Old formats. Every load path reads through here: YAML configs (training's `load_config`, `config_from_dict`, so a
run directory's config.yaml), checkpoint manifests (`format.read_manifest`: resume, reshard, Hugging Face export)
and model and optimizer shards (`format.read_shard`). What 0.1 and 0.2 wrote differently:
- config keys renamed (`RENAMED_KEYS`): 0.1.0's model.attention_backend and parallel.backend are read as
  model.attention_kernel and parallel.distributed_backend;
- config keys removed (`REMOVED_KEYS`): parallel.comm_chunks (0.1's chunked row-parallel forward) is read at 1,
  the value that changes nothing, and refused at any other;
- config keys added since (`ADDED_KEYS`): a config without them meant their defaults;
- checkpoint format 1 (0.1.0): fused QKV rows per query group, reordered as they are read (`upgrade_shard`);
- no data.sampling (before 0.3): the run drew random windows and keeps drawing them (`started_before_sampling`).
A user's own YAML with an old key is read too, with a FutureWarning: nothing tells it apart from the config.yaml of
a run directory written by 0.1, which must keep resuming.

Compatibility. A checkpoint fits when it holds the same model (every setting that shapes the weights; runtime
settings such as dropout may change across a resume), and, for an exact resume, the same layout
(tensor-parallel size and world size: RNG states and data positions are saved per rank).
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from typing import Any

import torch

from ..tensor_parallel.sharding import grouped_to_blocked_qkv
from ..transformer.model_config import ModelConfig
from .errors import CheckpointError

RENAMED_KEYS = {"model": {"attention_backend": "attention_kernel"}, "parallel": {"backend": "distributed_backend"}}
REMOVED_KEYS = {"parallel": {"comm_chunks": 1}}  # key: the one value still read (it behaves as if absent)
ADDED_KEYS = {"model": {f.name: f.default for f in dataclasses.fields(ModelConfig)
                        if f.name in ("rope_type", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                                      "rope_original_max_seq_len", "qk_norm", "qk_norm_scope", "num_experts")
                        or f.name.startswith("moe_")}}  # the mixture-of-experts keys: absent means dense


def upgrade_section(section: str, data: Any, warn: bool = False) -> Any:
    """One config section (`model`, `parallel`, ...) under today's keys: renamed keys under their new names (both
    at once is an error), removed keys dropped at their neutral value (refused at any other), added keys at their
    defaults where absent. `warn`: a FutureWarning for each old key (a user's YAML; never for a manifest)."""
    if not isinstance(data, dict):
        return data  # not a mapping: the config loader names the error
    data = dict(data)
    for key, default in ADDED_KEYS.get(section, {}).items():
        data.setdefault(key, default)
    for old, new in RENAMED_KEYS.get(section, {}).items():
        if old in data:
            if new in data:
                raise ValueError(f"{section}.{old} and {section}.{new} are both set: {section}.{old} is the 0.1 "
                                 f"name of {section}.{new}; keep only {section}.{new}.")
            if warn:
                warnings.warn(f"config key {section}.{old} is the 0.1 name of {section}.{new}: call it "
                              f"{section}.{new}.", FutureWarning, stacklevel=4)
            data[new] = data.pop(old)
    for key, neutral in REMOVED_KEYS.get(section, {}).items():
        if key in data:
            value = data.pop(key)
            if value != neutral:
                raise ValueError(f"{section}.{key}={value!r}: the key was removed in 0.2; only {section}.{key}="
                                 f"{neutral!r}, which changes nothing, is still read: drop the key.")
            if warn:
                warnings.warn(f"config key {section}.{key} was removed in 0.2 and is ignored: drop it.",
                              FutureWarning, stacklevel=4)
    return data


def upgrade_run_config(config: Any, warn: bool = False) -> Any:
    """A run config (a YAML file's top-level mapping, or a manifest's `config`) with each section upgraded."""
    if not isinstance(config, dict):
        return config
    upgraded = dict(config)
    for name in RENAMED_KEYS.keys() | REMOVED_KEYS.keys() | ADDED_KEYS.keys():
        if name in upgraded:
            upgraded[name] = upgrade_section(name, upgraded[name], warn)
    return upgraded


def upgrade_manifest(manifest: dict) -> dict:
    """A manifest with its config under today's keys (the tensors are upgraded as read: `upgrade_shard`)."""
    if not isinstance(manifest.get("config"), dict):
        return manifest
    return {**manifest, "config": upgrade_run_config(manifest["config"])}


_FUSED_QKV = re.compile(r"(?:[^/]+/)?layers\.\d+\.attention\.query_key_value\.(?:weight|bias)")


def upgrade_shard(manifest: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors read from one tensor-parallel rank's model or optimizer file (`exp_avg/<name>`), in today's
    row order: format 1's per-group fused QKV rows are reordered (a permutation, so values are bit-exact)."""
    fused = [name for name, t in tensors.items() if _FUSED_QKV.fullmatch(name) and t.dim() > 0]
    if manifest["format_version"] >= 2 or not fused:
        return tensors
    attn = saved_model_config(manifest).attention_config()
    p = manifest["tensor_parallel_size"]
    reordered = {name: grouped_to_blocked_qkv(tensors[name], attn.num_heads, attn.num_kv_heads, attn.head_dim, p)
                 for name in fused}
    return {**tensors, **reordered}


def started_before_sampling(saved_config: Any) -> bool:
    """Whether a run config (a manifest's) was written before data.sampling existed (0.1, 0.2): that run drew
    random windows, and resumed keeps drawing them."""
    data = saved_config.get("data") if isinstance(saved_config, dict) else None
    return isinstance(data, dict) and "sampling" not in data


def saved_model_config(manifest: dict) -> ModelConfig:
    """The model a manifest holds, whichever release wrote it."""
    return ModelConfig.from_dict(upgrade_section("model", manifest["config"]["model"]))


# settings that change how the model runs, not what its weights are
RUNTIME_MODEL_KEYS = frozenset({"hidden_dropout", "attention_dropout", "dropout_rng", "recompute_activations",
                                "recompute_granularity", "attention_kernel", "compile"})


def model_shape_config(model: ModelConfig) -> dict:
    """The model settings a checkpoint must match (JSON-normalised, as a manifest stores them)."""
    shaping = {k: v for k, v in dataclasses.asdict(model).items() if k not in RUNTIME_MODEL_KEYS}
    return json.loads(json.dumps(shaping))


def check_same_model(manifest: dict, model: ModelConfig, where) -> None:
    """Refuse a checkpoint of another model, naming each differing `model.*` setting."""
    saved = model_shape_config(saved_model_config(manifest))
    wanted = model_shape_config(model)
    differs = [f"model.{k}: checkpoint {saved.get(k)!r}, this run {v!r}" for k, v in wanted.items()
               if saved.get(k) != v]
    if differs:
        raise CheckpointError(f"{where} holds another model: " + "; ".join(differs))


_LAYER_NAME = re.compile(r"layers\.(\d+)\.")


def saved_stage_layers(manifest: dict) -> list[list[int]]:
    """The layers (global indices) each pipeline stage of a checkpoint holds, in stage order: read from its files'
    names (`model_shapes`), so whatever split wrote them (an earlier release's balanced split, an explicit
    `pipeline_layers`); a checkpoint without shapes (pp = 1 only) holds every layer."""
    shapes = manifest.get("model_shapes")
    if not isinstance(shapes, dict) or not shapes:
        return [list(range(manifest["config"]["model"]["num_layers"]))]
    first_rank = sorted(name for name in shapes if name.split("_")[0] == "tp00")  # tp00, or tp00_pp00, tp00_pp01 ...
    return [sorted({int(m.group(1)) for name in shapes[shard] if (m := _LAYER_NAME.match(name))})
            for shard in first_rank]


def same_layout(manifest: dict, tensor_parallel_size: int, world_size: int, stage_layers: list[list[int]]) -> bool:
    """Whether an exact resume is possible (else the checkpoint is resharded on load): the same tensor-parallel
    and world sizes, and each pipeline rank's files holding the layers it holds in this run (`stage_layers`, in
    pipeline-rank order)."""
    return (manifest["tensor_parallel_size"], manifest["world_size"]) == (tensor_parallel_size, world_size) \
        and saved_stage_layers(manifest) == stage_layers and not manifest.get("resharded")


def describe_layout(tensor_parallel_size: int, world_size: int, stage_layers: list[list[int]]) -> str:
    """A layout in a few words: 'tp 2 x pp 2 (layers 0-1 | 2-3), 4 ranks'."""
    words = f"tp {tensor_parallel_size}"
    if len(stage_layers) > 1:
        words += f" x pp {len(stage_layers)} (layers {' | '.join(_ranges(layers) for layers in stage_layers)})"
    return f"{words}, {world_size} rank{'s' * (world_size != 1)}"


def layer_runs(layers: list[int]) -> list[list[int]]:
    """[0, 1, 4, 5] -> [[0, 1], [4, 5]]: a rank's contiguous runs of layers (its model chunks)."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return runs


def _ranges(layers: list[int]) -> str:
    """[0, 1, 4, 5] -> '0-1, 4-5'."""
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in layer_runs(layers))


def check_layout(manifest: dict, world_size: int, tp_size: int, pp_size: int = 1) -> None:
    """Refuse an exact load at another layout, saying why and what to do."""
    if manifest.get("pipeline_parallel_size", 1) != pp_size:
        raise CheckpointError(
            f"this checkpoint was written at pipeline_parallel_size={manifest.get('pipeline_parallel_size', 1)}, "
            f"this run uses {pp_size} (an exact load needs the same stages): resume through load_resharded "
            "(pretrain.py does).")
    if manifest["tensor_parallel_size"] != tp_size:
        raise CheckpointError(
            f"this checkpoint was written at tensor_parallel_size={manifest['tensor_parallel_size']}, "
            f"this run uses {tp_size} (an exact load needs the same size; resharding does not): resume through "
            "load_resharded (pretrain.py does), or reshard it with scripts/reshard_checkpoint.py.")
    if manifest["world_size"] != world_size:
        raise CheckpointError(
            f"this checkpoint was written by world_size={manifest['world_size']} "
            f"(data_parallel_size={manifest['data_parallel_size']}), this run has world_size={world_size} "
            f"(data_parallel_size={world_size // (tp_size * pp_size)}): every rank's RNG state and data position are "
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
    if "model" in saved_config:  # under today's keys; not ModelConfig.from_dict: absent keys must stay absent
        saved_config["model"] = upgrade_section("model", saved_config["model"])
    saved = flatten_dict(saved_config)
    wanted = flatten_dict(json.loads(json.dumps(expected_config)))  # JSON turned tuples into lists
    missing = object()
    diffs = [f"{key}: checkpoint {saved.get(key, '<absent>')!r}, run {value!r}"
             for key, value in wanted.items() if saved.get(key, missing) != value]
    if diffs:
        raise CheckpointError("the checkpoint's config differs from this run's: " + "; ".join(diffs) + ".")
