"""GPTModel's state dict <-> canonical (full, p-independent) state dict, as pure functions.

Sharded keys are those of `GPTModel.state_dict()` on one rank; canonical keys are
Hugging Face-like (`layers.0.attention.q_proj.weight`, `layers.0.mlp.gate_proj.weight`, ...).
Used by GPTModel itself, by checkpoint resharding (any p to any p' without processes) and by
the Hugging Face conversion. The rule for each kind of weight lives in `sharding`.
"""

from __future__ import annotations

import re

import torch

from ..tensor_parallel import sharding
from .model_config import ModelConfig
from .pipeline_stage import PipelineStage

_ATTN = re.compile(r"layers\.(\d+)\.attention\.(query_key_value|dense)\.(weight|bias)")
_QK_NORM = re.compile(r"layers\.\d+\.attention\.([qk])_norm\.weight")
_MLP = re.compile(r"layers\.(\d+)\.mlp\.((?:shared_expert\.)?)(fc_in|fc_out)\.(weight|bias)")


def _mlp_names(cfg: ModelConfig) -> tuple[tuple[str, ...], str]:
    return (("gate_proj", "up_proj"), "down_proj") if cfg.activation == "swiglu" else (("fc_in",), "fc_out")


def state_dict_keys(cfg: ModelConfig, stage: PipelineStage = PipelineStage()) -> list[str]:
    """The keys of GPTModel(cfg, stage=stage).state_dict() (the same at every p), without building the model; a
    pipeline stage's last chunk holds a copy of a tied embedding table."""
    norm = ["weight", "bias"] if cfg.norm == "layernorm" else ["weight"]
    table = stage.has_embedding or (stage.has_head and cfg.tie_embeddings)
    keys = (["embed_positions"] if cfg.position_embedding == "learned" and stage.has_embedding else []) + (
        ["embed_tokens.weight"] if table else [])  # the model's own parameters come before its modules'
    for i in (i for layers in stage.layer_ranges(cfg.num_layers) for i in layers):
        keys += [f"layers.{i}.input_norm.{n}" for n in norm]
        keys += [f"layers.{i}.attention.query_key_value.weight"] + (
            [f"layers.{i}.attention.query_key_value.bias"] if cfg.qkv_bias else [])
        keys += [f"layers.{i}.attention.dense.weight"] + ([f"layers.{i}.attention.dense.bias"] if cfg.out_bias else [])
        keys += [f"layers.{i}.attention.{n}_norm.weight" for n in ("q", "k") if cfg.qk_norm]
        keys += [f"layers.{i}.post_attention_norm.{n}" for n in norm]
        keys += _moe_keys(cfg, i) if cfg.is_moe_layer(i) else [
            f"layers.{i}.mlp.{module}.{kind}" for module in ("fc_in", "fc_out")
            for kind in (("weight", "bias") if cfg.mlp_bias else ("weight",))]
    if not stage.has_head:
        return keys
    return keys + [f"final_norm.{n}" for n in norm] + ([] if cfg.tie_embeddings else ["lm_head.weight"])


def _moe_keys(cfg: ModelConfig, i: int) -> list[str]:
    """An MoE layer's keys (MoELayer): its router, its experts (all of them: the checkpoint's are whole), its shared
    expert and that expert's gate."""
    prefix = f"layers.{i}.mlp."
    keys = [f"{prefix}gate.weight"] + ([f"{prefix}gate.e_score_correction_bias"]
                                       if cfg.moe_router_bias_update_rate > 0 else [])
    keys += [f"{prefix}experts.{n}" for n in (("gate_up_proj", "down_proj") if cfg.activation == "swiglu"
                                              else ("fc_in", "fc_out"))]
    if cfg.moe_shared_expert_ffn_hidden_size:
        keys += [f"{prefix}shared_expert.fc_in.weight", f"{prefix}shared_expert.fc_out.weight"]
        keys += [f"{prefix}shared_expert_gate.weight"] if cfg.moe_shared_expert_gate else []
    return keys


def canonical_sources(cfg: ModelConfig, key: str) -> tuple[str, list[str]]:
    """(kind, canonical names) the sharded `key` is built from."""
    if key in ("embed_tokens.weight", "lm_head.weight"):
        return "vocab", [key]
    if key == "embed_positions":
        return "replicated", ["embed_positions.weight"]
    m = _ATTN.fullmatch(key)
    if m:
        layer, module, kind = m.groups()
        prefix = f"layers.{layer}.attention."
        if module == "query_key_value":
            return "qkv", [f"{prefix}{n}.{kind}" for n in ("q_proj", "k_proj", "v_proj")]
        return ("row" if kind == "weight" else "replicated"), [f"{prefix}o_proj.{kind}"]
    m = _MLP.fullmatch(key)
    if m:
        layer, shared, module, kind = m.groups()
        ins, out = _mlp_names(cfg)
        prefix = f"layers.{layer}.mlp.{shared}"
        if module == "fc_in":
            return ("gated" if len(ins) == 2 else "column"), [f"{prefix}{n}.{kind}" for n in ins]
        return ("row" if kind == "weight" else "replicated"), [f"{prefix}{out}.{kind}"]
    m = _QK_NORM.fullmatch(key)
    if cfg.qk_norm_scope == "projection" and m:  # the rows of this rank's heads, as the q and k projections' rows
        return ("column" if m.group(1) == "q" else "kv_heads"), [key]
    return "replicated", [key]  # norms


def shard(cfg: ModelConfig, key: str, canonical: dict[str, torch.Tensor], p: int, rank: int) -> torch.Tensor:
    kind, names = canonical_sources(cfg, key)
    tensors = [canonical[n] for n in names]
    if kind == "vocab":
        return sharding.vocab_shard(tensors[0], sharding.padded_vocab_size(cfg.vocab_size, p), p, rank)
    if kind == "qkv":
        attn = cfg.attention_config()
        return sharding.fuse_qkv(*tensors, attn.num_heads, attn.num_kv_heads, attn.head_dim, p, rank)
    if kind == "gated":
        return sharding.fuse_gated(*tensors, p, rank)
    if kind == "column":
        return sharding.column_shard(tensors[0], p, rank)
    if kind == "kv_heads":
        return sharding.head_rows(tensors[0], cfg.attention_config().num_kv_heads, p, rank)
    if kind == "row":
        return sharding.row_shard(tensors[0], p, rank)
    return tensors[0]


def unshard(cfg: ModelConfig, key: str, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical tensors from every rank's shard of `key` (p = len(shards))."""
    kind, names = canonical_sources(cfg, key)
    if kind == "vocab":
        values = [sharding.vocab_unshard(shards, cfg.vocab_size)]
    elif kind == "qkv":
        attn = cfg.attention_config()
        values = list(sharding.unfuse_qkv(shards, attn.num_heads, attn.num_kv_heads, attn.head_dim))
    elif kind == "gated":
        values = list(sharding.unfuse_gated(shards))
    elif kind == "column":
        values = [torch.cat(shards, dim=0)]
    elif kind == "kv_heads":
        values = [sharding.head_rows_unshard(shards, cfg.attention_config().num_kv_heads)]
    elif kind == "row":
        values = [torch.cat(shards, dim=1)]
    else:
        values = [shards[0]]
    return dict(zip(names, values))


def shard_state_dict(cfg: ModelConfig, keys: list[str], canonical: dict[str, torch.Tensor], p: int,
                     rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s state dict (for the sharded `keys`) at tensor-parallel size p."""
    cfg.attention_config().per_rank_heads(p)  # raises, naming the values, where p cannot split the heads
    if cfg.resolved_ffn_hidden_size() % p != 0:
        raise ValueError(f"ffn_hidden_size={cfg.resolved_ffn_hidden_size()} is not divisible by "
                         f"tensor_parallel_size={p}.")
    return {key: shard(cfg, key, canonical, p, rank).contiguous() for key in keys}


def unshard_state_dict(cfg: ModelConfig, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The canonical state dict from every rank's state dict (p = len(shards))."""
    canonical = {}
    for key in shards[0]:
        canonical.update(unshard(cfg, key, [s[key] for s in shards]))
    return canonical
