"""The rotary fields of a Llama-family config.json <-> ModelConfig's rope_theta and rope_* scaling fields.

Two spellings exist, and both are read:
    transformers < 5   rope_theta at the top level; rope_scaling: null or {"rope_type" (or "type"): ..., factor, ...}
    transformers >= 5  rope_parameters: {"rope_type": ..., "rope_theta": ..., factor, ...} (rope_scaling, if a
                       non-empty mapping, still takes precedence, as transformers 5 reads it)
rope_type 'default' and 'llama3' are computed here (transformer/rotary.py); any other kind is refused by name.
For llama3, original_max_position_embeddings falls back to the top-level field of that name, then to
max_position_embeddings, as transformers does. Writing gives both spellings, so that either version reads it.
"""

from __future__ import annotations

from typing import Any

from ..transformer.model_config import ModelConfig
from ..transformer.rotary import ROPE_TYPES

LLAMA3_KEYS = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor"}


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"config.json: {what}={value!r} must be a positive number.")
    return float(value)


def rope_from_hf(f) -> dict[str, Any]:
    """ModelConfig's rope_theta and rope_* fields from a config.json read by hf.config._Fields `f`."""
    scaling, params = f.get("rope_scaling"), f.get("rope_parameters")
    source, rope = ("rope_scaling", scaling) if scaling else ("rope_parameters", params or {})
    if not isinstance(rope, dict):
        raise ValueError(f"config.json: {source}={rope!r} must be a mapping or null.")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"config.json: {source}.rope_type={kind!r} is not supported: this model computes rope_type "
                         f"{' and '.join(repr(t) for t in ROPE_TYPES)} (linear, dynamic, yarn, longrope and the "
                         "others are not implemented).")
    theta, top_level = rope.get("rope_theta"), f.get("rope_theta")
    if theta is not None and "rope_theta" in f.hf and theta != top_level:
        raise ValueError(f"config.json: rope_theta={top_level!r} disagrees with {source}.rope_theta={theta!r}.")
    theta = top_level if theta is None else theta
    partial = rope.get("partial_rotary_factor", f.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config.json: partial_rotary_factor={partial!r} is not supported: rotary covers the "
                         "whole head dim here (1.0).")
    out = {"rope_theta": _positive(theta, "rope_theta"), "rope_type": kind}
    if kind == "llama3":
        out.update(_llama3_from_hf(f, source, rope))
    return out


def _llama3_from_hf(f, source: str, rope: dict[str, Any]) -> dict[str, Any]:
    missing = [k for k in LLAMA3_KEYS if k not in rope]
    if missing:
        raise ValueError(f"config.json: {source} with rope_type 'llama3' lacks {missing}: llama3 scaling needs "
                         f"{', '.join(LLAMA3_KEYS)} (and original_max_position_embeddings).")
    out = {field: _positive(rope[key], f"{source}.{key}") for key, field in LLAMA3_KEYS.items()}
    original = rope.get("original_max_position_embeddings",
                        f.hf.get("original_max_position_embeddings", f.get("max_position_embeddings")))
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(f"config.json: {source}.original_max_position_embeddings={original!r} must be a positive "
                         "integer.")
    f.used.add("original_max_position_embeddings")
    return {**out, "rope_original_max_seq_len": original}


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's rotary fields for `cfg`, in both spellings."""
    if cfg.rope_type == "default":
        return {"rope_theta": cfg.rope_theta, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    scaling = {"rope_type": cfg.rope_type, **{key: getattr(cfg, field) for key, field in LLAMA3_KEYS.items()},
               "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling,
            "rope_parameters": {**scaling, "rope_theta": cfg.rope_theta}}
