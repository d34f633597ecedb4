"""ModelConfig -> Hugging Face `config.json`: the inverse of hf.config's mapping.

The architecture is the one imported from (pass the source config.json), or, failing that, the one the
ModelConfig's shape implies (GPT-2, Llama, Qwen2, Qwen3, in that order). A ModelConfig the chosen
architecture cannot express is refused with the fields at fault.
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
              "Qwen2ForCausalLM": (True, False, False, False), "Qwen3ForCausalLM": (None, None, False, True)}
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
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and cfg.qkv_bias != cfg.out_bias:
        out.append(f"qkv_bias={cfg.qkv_bias} with out_bias={cfg.out_bias} (one attention_bias for both)")
    return out


def infer_architecture(cfg: ModelConfig) -> str:
    for arch in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not _misfits(cfg, arch):
            return arch
    raise ValueError("this ModelConfig is neither GPT-2 nor Llama (nor Qwen2, Qwen3) shaped: " + "; ".join(
        f"as {a} {_misfits(cfg, a)}" for a in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM",
                                              "Qwen3ForCausalLM")) + ".")


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
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers,
                   layer_types=["full_attention"] * cfg.num_layers)
        return {**out, "attention_bias": cfg.qkv_bias} if arch == "Qwen3ForCausalLM" else out
    return {**out, "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias, "pretraining_tp": 1}


def _gpt2_fields(cfg: ModelConfig) -> dict[str, Any]:
    h = cfg.hidden_size
    ffn = cfg.resolved_ffn_hidden_size()
    return dict(vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=h, n_layer=cfg.num_layers,
                n_head=cfg.num_heads, n_inner=None if ffn == 4 * h else ffn, activation_function="gelu_new",
                resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout, attn_pdrop=cfg.attention_dropout,
                layer_norm_epsilon=cfg.norm_eps, initializer_range=cfg.init_std, scale_attn_weights=True,
                scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, add_cross_attention=False,
                tie_word_embeddings=cfg.tie_embeddings)
