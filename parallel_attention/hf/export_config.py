"""ModelConfig -> Hugging Face `config.json`: the inverse of hf.config's mapping.

The architecture is the one imported from (pass the source config.json), or, failing that, the one the
ModelConfig's shape implies (GPT-2, Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, in that
order). A ModelConfig the chosen architecture cannot express is refused with the fields at fault.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..transformer.model_config import ModelConfig
from .families import FAMILY, MODEL_TYPE, architecture_of
from .family_tables import CARRIED
from .rope_config import rope_to_hf

# (qkv_bias, out_bias, mlp_bias, qk_norm) each architecture can hold; None: either value
_ATTENTION = {"LlamaForCausalLM": (None, None, None, False), "MistralForCausalLM": (False, False, False, False),
              "Qwen2ForCausalLM": (True, False, False, False), "Qwen3ForCausalLM": (None, None, False, True),
              "MixtralForCausalLM": (False, False, False, False), "Qwen2MoeForCausalLM": (None, False, False, False),
              "Qwen3MoeForCausalLM": (None, None, False, True),
              "OlmoeForCausalLM": (None, None, False, True)}
# the q/k norm's span where it has one: per head (Qwen3) or over the whole projection (OLMoE)
_QK_NORM_SCOPE = {"Qwen3ForCausalLM": "head", "Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "projection"}
# what each mixture-of-experts architecture can hold: (renormalised top-k or None: either, shared expert, every
# layer MoE); the router is softmax without a balancing bias in all three
_EXPERTS = {"MixtralForCausalLM": (True, False, True), "Qwen2MoeForCausalLM": (None, True, False),
            "Qwen3MoeForCausalLM": (None, False, False), "OlmoeForCausalLM": (None, False, True)}
_SWITCHES = ("qkv_bias", "out_bias", "mlp_bias", "qk_norm")


def _misfits(cfg: ModelConfig, arch: str) -> list[str]:
    """What keeps `cfg` from being written as `arch` (empty: it can be)."""
    gpt2 = FAMILY[arch] == "gpt2"
    want = (("position_embedding", "learned"), ("norm", "layernorm"), ("activation", "gelu")) if gpt2 else \
        (("position_embedding", "rotary"), ("norm", "rmsnorm"), ("activation", "swiglu"))
    out = [f"{k}={getattr(cfg, k)!r} (needs {v!r})" for k, v in want if getattr(cfg, k) != v]
    if gpt2:
        out += [f"{k}=False (needs True)" for k in ("qkv_bias", "out_bias", "mlp_bias") if not getattr(cfg, k)]
        out += ["qk_norm=True (needs False)"] if cfg.qk_norm else []
        if cfg.num_kv_heads not in (None, cfg.num_heads):
            out.append(f"num_kv_heads={cfg.num_kv_heads} (needs num_heads={cfg.num_heads})")
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim not in (None, cfg.hidden_size // cfg.num_heads):
            out.append(f"head_dim={cfg.head_dim} (needs hidden_size / num_heads)")
        return out
    out += [f"{k}={getattr(cfg, k)} (needs {v})" for k, v in zip(_SWITCHES, _ATTENTION[arch])
            if v is not None and getattr(cfg, k) != v]
    out += _expert_misfits(cfg, arch)
    if cfg.qk_norm and _QK_NORM_SCOPE.get(arch, cfg.qk_norm_scope) != cfg.qk_norm_scope:
        out.append(f"qk_norm_scope={cfg.qk_norm_scope!r} (needs {_QK_NORM_SCOPE[arch]!r})")
    if arch == "OlmoeForCausalLM" and (cfg.hidden_size % cfg.num_heads or cfg.head_dim not in
                                       (None, cfg.hidden_size // cfg.num_heads)):
        out.append(f"head_dim={cfg.head_dim} (needs hidden_size / num_heads: OLMoE's q norm spans hidden_size)")
    if arch in ("LlamaForCausalLM", *_QK_NORM_SCOPE) and cfg.qkv_bias != cfg.out_bias:
        out.append(f"qkv_bias={cfg.qkv_bias} with out_bias={cfg.out_bias} (one attention_bias for both)")
    return out


def _expert_misfits(cfg: ModelConfig, arch: str) -> list[str]:
    if arch not in _EXPERTS:
        return [f"num_experts={cfg.num_experts} (needs 0: {arch} is dense)"] if cfg.num_experts else []
    renormalize, shared, every_layer = _EXPERTS[arch]
    out = [] if cfg.num_experts else [f"num_experts=0 (needs experts: {arch} is a mixture of experts)"]
    if renormalize is not None and cfg.moe_router_renormalize != renormalize:
        out.append(f"moe_router_renormalize={cfg.moe_router_renormalize} (needs {renormalize})")
    if bool(cfg.moe_shared_expert_ffn_hidden_size) != shared or cfg.moe_shared_expert_gate != shared:
        out.append(f"moe_shared_expert_ffn_hidden_size={cfg.moe_shared_expert_ffn_hidden_size}, moe_shared_expert_gate="
                   f"{cfg.moe_shared_expert_gate} (needs {'a gated shared expert' if shared else 'none'})")
    if every_layer and (cfg.moe_layer_freq, cfg.moe_first_dense_layers) != (1, 0):
        out.append(f"moe_layer_freq={cfg.moe_layer_freq}, moe_first_dense_layers={cfg.moe_first_dense_layers} "
                   "(needs every layer MoE)")
    if cfg.moe_router_score != "softmax" or cfg.moe_router_bias_update_rate:
        out.append(f"moe_router_score={cfg.moe_router_score!r}, moe_router_bias_update_rate="
                   f"{cfg.moe_router_bias_update_rate} (needs softmax, 0)")
    return out


# the order an architecture is inferred in
_INFERRED = ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM",
             "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")


def infer_architecture(cfg: ModelConfig) -> str:
    for arch in _INFERRED:
        if not _misfits(cfg, arch):
            return arch
    raise ValueError("this ModelConfig is neither GPT-2 nor Llama (nor Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, "
                     "OLMoE) "
                     "shaped: " + "; ".join(f"as {a} {_misfits(cfg, a)}" for a in _INFERRED) + ".")


def hf_config_from_model(cfg: ModelConfig, architecture: str | None = None,
                         source: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json for `cfg` as `architecture` (default: the source config's, else what cfg implies)."""
    arch = architecture or (architecture_of(source) if source else infer_architecture(cfg))
    if arch not in FAMILY:
        raise ValueError(f"cannot export as {arch!r}: choose one of {', '.join(FAMILY)}.")
    misfits = _misfits(cfg, arch)
    if misfits:
        raise ValueError(f"cannot export this ModelConfig as {arch}: {'; '.join(misfits)}.")
    body = _gpt2_fields(cfg) if FAMILY[arch] == "gpt2" else _llama_fields(cfg, arch)
    carried = {k: (source or {}).get(k) for k in CARRIED}
    return {"architectures": [arch], "model_type": MODEL_TYPE[arch], **body, **carried}


def _llama_fields(cfg: ModelConfig, arch: str) -> dict[str, Any]:
    if cfg.hidden_dropout:
        warnings.warn(f"{arch} has no hidden dropout: model.hidden_dropout={cfg.hidden_dropout} is dropped "
                      "(training-only; the exported forward is unchanged).", UserWarning, stacklevel=3)
    nh = cfg.num_heads
    out = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.resolved_ffn_hidden_size(),
               num_hidden_layers=cfg.num_layers, num_attention_heads=nh, num_key_value_heads=cfg.num_kv_heads or nh,
               head_dim=cfg.head_dim or cfg.hidden_size // nh, hidden_act="silu",
               max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
               tie_word_embeddings=cfg.tie_embeddings, attention_dropout=cfg.attention_dropout,
               initializer_range=cfg.init_std, **rope_to_hf(cfg))
    if arch == "MistralForCausalLM":
        return {**out, "sliding_window": None}
    if arch == "MixtralForCausalLM":  # its intermediate_size is the experts' width
        return {**out, "sliding_window": None, "intermediate_size": cfg.resolved_moe_ffn_hidden_size(),
                "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_top_k,
                "router_aux_loss_coef": cfg.moe_aux_loss_coeff}
    if arch == "OlmoeForCausalLM":  # likewise; head_dim is hidden_size / num_attention_heads, not a field
        out.pop("head_dim")
        return {**out, "intermediate_size": cfg.resolved_moe_ffn_hidden_size(), "num_experts": cfg.num_experts,
                "num_experts_per_tok": cfg.moe_top_k, "norm_topk_prob": cfg.moe_router_renormalize,
                "router_aux_loss_coef": cfg.moe_aux_loss_coeff, "attention_bias": cfg.qkv_bias, "clip_qkv": None}
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers,
                   layer_types=["full_attention"] * cfg.num_layers)
        out.update(_qwen_experts(cfg) if cfg.num_experts else {})
        if arch == "Qwen2MoeForCausalLM":
            return {**out, "qkv_bias": cfg.qkv_bias,
                    "shared_expert_intermediate_size": cfg.moe_shared_expert_ffn_hidden_size}
        return {**out, "attention_bias": cfg.qkv_bias} if arch != "Qwen2ForCausalLM" else out
    return {**out, "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias, "pretraining_tp": 1}


def _qwen_experts(cfg: ModelConfig) -> dict[str, Any]:
    return dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_top_k,
                moe_intermediate_size=cfg.resolved_moe_ffn_hidden_size(), norm_topk_prob=cfg.moe_router_renormalize,
                decoder_sparse_step=cfg.moe_layer_freq, mlp_only_layers=list(range(cfg.moe_first_dense_layers)),
                router_aux_loss_coef=cfg.moe_aux_loss_coeff)


def _gpt2_fields(cfg: ModelConfig) -> dict[str, Any]:
    h = cfg.hidden_size
    ffn = cfg.resolved_ffn_hidden_size()
    return dict(vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=h, n_layer=cfg.num_layers,
                n_head=cfg.num_heads, n_inner=None if ffn == 4 * h else ffn, activation_function="gelu_new",
                resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout, attn_pdrop=cfg.attention_dropout,
                layer_norm_epsilon=cfg.norm_eps, initializer_range=cfg.init_std, scale_attn_weights=True,
                scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, add_cross_attention=False,
                tie_word_embeddings=cfg.tie_embeddings)
