"""The supported transformers architectures, the one registry (`FAMILIES`): for the converter, each one's
model_type, weight-rule table (`weights`) and config class defaults (`family_tables`); for `parallelize`, where
it keeps its pieces and how to read its attention.

    architecture         layers           attention   embedding            q/k/v              extra
    LlamaForCausalLM     model.layers     self_attn   model.embed_tokens   q_proj, k_proj..   rope scaling, biases
    MistralForCausalLM   model.layers     self_attn   model.embed_tokens   q_proj, k_proj..   sliding window
    Qwen2ForCausalLM     model.layers     self_attn   model.embed_tokens   q_proj, k_proj..   q/k/v bias, windows
    Qwen3ForCausalLM     model.layers     self_attn   model.embed_tokens   q_proj, k_proj..   q/k RMSNorm per head
    OlmoeForCausalLM     model.layers     self_attn   model.embed_tokens   q_proj, k_proj..   q/k RMSNorm per projection
    GPT2LMHeadModel      transformer.h    attn        transformer.wte      c_attn (Conv1D)    learned positions

The MLP of the MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: model.layers[i].mlp) is a sparse block or, in
Qwen2/3-MoE's dense layers, a gated MLP (`tp_moe.moe_or_dense`). Sliding windows are transformers' own masks (built
by the model, passed to each layer): honoured as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from . import family_tables as tables
from .tp_mlp import Conv1DMLP, GatedMLP
from .tp_moe import moe_or_dense


class _AttentionSource:
    """What every family's attention module keeps under the same names."""

    def head_dim(self, old):
        return old.head_dim

    def scaling(self, old):
        return old.scaling

    def num_heads(self, config):
        return config.num_attention_heads


class LlamaAttentionSource(_AttentionSource):
    """Llama, Mistral, Qwen2, Qwen3: separate q/k/v/o projections, rotary embeddings from the model."""

    rotary = True

    def attention_dropout(self, old):
        return old.config.attention_dropout

    def sliding_window(self, old):
        return getattr(old, "sliding_window", None)

    def num_kv_heads(self, config):
        return config.num_key_value_heads

    def weights(self, old):
        return tuple(getattr(old, n).weight.detach() for n in ("q_proj", "k_proj", "v_proj", "o_proj"))

    def biases(self, old):
        if old.q_proj.bias is None:
            return None
        return tuple(getattr(old, n).bias.detach() for n in ("q_proj", "k_proj", "v_proj"))

    def o_bias(self, old):
        return None if old.o_proj.bias is None else old.o_proj.bias.detach()

    def head_norms(self, old):
        return (old.q_norm, old.k_norm) if hasattr(old, "q_norm") else None

    def projection_norms(self, old):
        return None

    def state_dict(self, full, o_weight, o_bias) -> dict[str, torch.Tensor]:
        out = {f"{n}.weight": t for n, t in zip(("q_proj", "k_proj", "v_proj"), full["weight"])}
        if full["bias"] is not None:
            out.update({f"{n}.bias": t for n, t in zip(("q_proj", "k_proj", "v_proj"), full["bias"])})
        out["o_proj.weight"] = o_weight
        if o_bias is not None:
            out["o_proj.bias"] = o_bias
        return out


class MistralAttentionSource(LlamaAttentionSource):
    def sliding_window(self, old):
        return getattr(old.config, "sliding_window", None)


class OlmoeAttentionSource(MistralAttentionSource):
    """OLMoE: q/k RMSNorms over the whole projections (q_norm [nh d], k_norm [nkv d]), not per head."""

    def head_norms(self, old):
        return None

    def projection_norms(self, old):
        return old.q_norm, old.k_norm


class GPT2AttentionSource(_AttentionSource):
    """GPT-2: one Conv1D c_attn ([h, 3h], x @ W) for q, k, v; no rotary (learned positions, replicated)."""

    rotary = False

    def attention_dropout(self, old):
        return old.attn_dropout.p

    def sliding_window(self, old):
        return None

    def num_kv_heads(self, config):
        return config.num_attention_heads

    def weights(self, old):
        q, k, v = old.c_attn.weight.detach().t().chunk(3, dim=0)
        return q, k, v, old.c_proj.weight.detach().t()

    def biases(self, old):
        return old.c_attn.bias.detach().chunk(3)

    def o_bias(self, old):
        return old.c_proj.bias.detach()

    def head_norms(self, old):
        return None

    def projection_norms(self, old):
        return None

    def state_dict(self, full, o_weight, o_bias) -> dict[str, torch.Tensor]:
        return {"c_attn.weight": torch.cat(full["weight"]).t().contiguous(), "c_attn.bias": torch.cat(full["bias"]),
                "c_proj.weight": o_weight.t().contiguous(), "c_proj.bias": o_bias}


@dataclass(frozen=True)
class Family:
    """One architecture: what its config.json says (`model_type`, the class `defaults` of its fields), which
    weight-rule table converts its files (`weights`: "llama" or "gpt2"), and where it keeps its pieces
    (attribute paths from the *ForCausalLM) and how to read them."""

    model_type: str
    weights: str
    defaults: dict
    decoder: str  # the base model inside the *ForCausalLM
    layers: str
    embedding: str
    attention: str
    attention_source: object
    mlp: Callable[[nn.Module, object], nn.Module]  # (transformers' MLP, group) -> its tensor-parallel replacement

    def intermediate_size(self, config) -> int:
        return getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size


_LLAMA_LIKE = dict(weights="llama", decoder="model", layers="layers", embedding="embed_tokens", attention="self_attn",
                   mlp=GatedMLP)
FAMILIES = {
    "LlamaForCausalLM": Family("llama", defaults=tables.LLAMA, attention_source=LlamaAttentionSource(), **_LLAMA_LIKE),
    "MistralForCausalLM": Family("mistral", defaults=tables.MISTRAL, attention_source=MistralAttentionSource(),
                                 **_LLAMA_LIKE),
    "Qwen2ForCausalLM": Family("qwen2", defaults=tables.QWEN2, attention_source=LlamaAttentionSource(),
                               **_LLAMA_LIKE),
    "Qwen3ForCausalLM": Family("qwen3", defaults=tables.QWEN3, attention_source=LlamaAttentionSource(),
                               **_LLAMA_LIKE),
    "MixtralForCausalLM": Family("mixtral", defaults=tables.MIXTRAL, attention_source=MistralAttentionSource(),
                                 **{**_LLAMA_LIKE, "mlp": moe_or_dense}),
    "Qwen2MoeForCausalLM": Family("qwen2_moe", defaults=tables.QWEN2_MOE, attention_source=LlamaAttentionSource(),
                                  **{**_LLAMA_LIKE, "mlp": moe_or_dense}),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", defaults=tables.QWEN3_MOE, attention_source=LlamaAttentionSource(),
                                  **{**_LLAMA_LIKE, "mlp": moe_or_dense}),
    "OlmoeForCausalLM": Family("olmoe", defaults=tables.OLMOE, attention_source=OlmoeAttentionSource(),
                               **{**_LLAMA_LIKE, "mlp": moe_or_dense}),
    "GPT2LMHeadModel": Family("gpt2", weights="gpt2", defaults=tables.GPT2, decoder="transformer", layers="h",
                              embedding="wte", attention="attn", attention_source=GPT2AttentionSource(),
                              mlp=Conv1DMLP),
}
# the converter's views of the registry: architecture -> weight-rule table, model_type, config class defaults
FAMILY = {arch: family.weights for arch, family in FAMILIES.items()}
MODEL_TYPE = {arch: family.model_type for arch, family in FAMILIES.items()}
DEFAULTS = {arch: family.defaults for arch, family in FAMILIES.items()}


def architecture_of(hf: dict) -> str:
    """The supported architecture config.json names (or its model_type implies); ValueError otherwise."""
    model_type, archs = hf.get("model_type"), hf.get("architectures") or []
    if not archs:
        archs = [a for a, t in MODEL_TYPE.items() if t == model_type][:1] or [None]
    if len(archs) != 1 or archs[0] not in FAMILY or MODEL_TYPE[archs[0]] != model_type:
        raise ValueError(f"unsupported architecture {archs} (model_type {model_type!r}): this converter reads "
                         f"{', '.join(f'{a} (model_type {t!r})' for a, t in MODEL_TYPE.items())}.")
    return archs[0]


def family_of(model: nn.Module) -> Family:
    """The family of a transformers *ForCausalLM; ValueError naming it and the supported list otherwise."""
    name = type(model).__name__
    supported = sorted(FAMILIES)
    if name not in supported:
        raise ValueError(f"parallelize: architecture {name} is not supported; supported: {supported}.")
    return FAMILIES[name]


def check_supported(model: nn.Module, family: Family, p: int) -> None:
    """Refuse, naming the value and the fix, what parallelize cannot shard at p ranks."""
    config, name = model.config, type(model).__name__
    heads, kv = family.attention_source.num_heads(config), family.attention_source.num_kv_heads(config)
    if heads % p:
        raise ValueError(f"parallelize {name}: num_attention_heads={heads} is not divisible by tensor-parallel "
                         f"size {p}: choose a size that divides it.")
    if (kv >= p and kv % p) or (kv < p and p % kv):
        raise ValueError(f"parallelize {name}: num_key_value_heads={kv} and tensor-parallel size {p}: one must "
                         "divide the other.")
    sizes = {"intermediate_size": family.intermediate_size(config)}
    sizes.update({key: getattr(config, key) for key in ("moe_intermediate_size", "shared_expert_intermediate_size")
                  if getattr(config, key, None)})
    for key, size in sizes.items():
        if size % p:
            raise ValueError(f"parallelize {name}: {key}={size} is not divisible by tensor-parallel size {p}: "
                             "choose a size that divides it.")
    _check_moe_features(config, name)
    for feature in ("add_cross_attention", "reorder_and_upcast_attn"):
        if getattr(config, feature, False):
            raise ValueError(f"parallelize {name}: {feature}=True is not supported; set it False.")
    if any(type(p_).__name__ == "DTensor" for p_ in model.parameters()):
        raise ValueError(f"parallelize {name}: the model already holds DTensor parameters (tp_plan, FSDP): load "
                         "it without tp_plan and call parallelize before fully_shard.")


def _check_moe_features(config, name: str) -> None:
    """What the MoE families may hold that parallelize does not split: router jitter (random per rank), clip_qkv
    (a clamp the fused projection does not apply)."""
    if getattr(config, "router_jitter_noise", 0.0):
        raise ValueError(f"parallelize {name}: router_jitter_noise={config.router_jitter_noise} would draw "
                         "different noise on each rank; set it to 0.")
    if getattr(config, "clip_qkv", None) is not None:
        raise ValueError(f"parallelize {name}: clip_qkv={config.clip_qkv} is not supported; set it to None.")
