"""Hugging Face `config.json` <-> ModelConfig, for the two families this model can express exactly.

    Llama family  LlamaForCausalLM, MistralForCausalLM: rotary (default RoPE over the whole head,
                  rotate-half form), RMSNorm, SwiGLU, grouped-query attention, no hidden dropout
    GPT-2         GPT2LMHeadModel: learned positions, LayerNorm with bias, GELU (tanh form), biases everywhere

Reading is explicit: every field that changes the forward is either mapped to a ModelConfig field or
checked to hold the one value this model computes (else a ValueError names the field, its value and
what is supported). A field absent from config.json takes the Hugging Face class default, as
`from_pretrained` would. Fields known not to change the forward (token ids, bookkeeping) are ignored;
any other field draws a warning naming it.

Writing inverts the mapping; the architecture is the one imported from (pass the source config.json),
or, failing that, the one the ModelConfig's shape implies. A ModelConfig neither family can express
is refused with the fields at fault.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from ..checkpointing.tensor_io import size_of
from ..transformer.model_config import ModelConfig

FAMILY = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "GPT2LMHeadModel": "gpt2"}
MODEL_TYPE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "GPT2LMHeadModel": "gpt2"}

# Hugging Face class defaults of the fields read (what from_pretrained assumes when a field is absent).
_LLAMA = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
              max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
              mlp_bias=False, attention_dropout=0.0, initializer_range=0.02, rope_theta=10000.0,
              rope_scaling=None, rope_parameters=None, partial_rotary_factor=None, pretraining_tp=1)
_MISTRAL = {**{k: v for k, v in _LLAMA.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")},
            "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
            "sliding_window": 4096}
_GPT2 = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
             activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
             layer_norm_epsilon=1e-5, initializer_range=0.02, scale_attn_weights=True,
             scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, add_cross_attention=False,
             tie_word_embeddings=True)
DEFAULTS = {"LlamaForCausalLM": _LLAMA, "MistralForCausalLM": _MISTRAL, "GPT2LMHeadModel": _GPT2}

# Fields that do not change the forward: identity, bookkeeping, generation, other heads of GPT-2.
_NOT_MATH = {"architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
             "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
             "output_attentions", "output_hidden_states", "return_dict", "torchscript", "id2label", "label2id",
             "problem_type", "tokenizer_class", "prefix", "task_specific_params", "chunk_size_feed_forward",
             "is_encoder_decoder", "n_ctx", "summary_type", "summary_use_proj", "summary_activation",
             "summary_proj_to_labels", "summary_first_dropout"}
CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id")  # kept from the source config on export


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; a ValueError names the file, its size and the fault (json's own says neither
    which file nor that a truncated copy is the usual cause)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path} ({size_of(path)}) is not valid UTF-8 JSON ({error}): it is truncated or damaged; "
                         "copy or download it again.") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object: is it the file save_pretrained "
                         "writes under that name?")
    return data


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{hf_dir} holds no config.json: pass a directory written by save_pretrained.")
    return read_json_object(path)


def architecture_of(hf: dict[str, Any]) -> str:
    """The supported architecture config.json names (or its model_type implies); ValueError otherwise."""
    model_type, archs = hf.get("model_type"), hf.get("architectures") or []
    if not archs:
        archs = [a for a, t in MODEL_TYPE.items() if t == model_type][:1] or [None]
    if len(archs) != 1 or archs[0] not in FAMILY or MODEL_TYPE[archs[0]] != model_type:
        raise ValueError(f"unsupported architecture {archs} (model_type {model_type!r}): this converter reads "
                         f"{', '.join(f'{a} (model_type {t!r})' for a, t in MODEL_TYPE.items())}.")
    return archs[0]


class _Fields:
    """config.json read against the class defaults, remembering which fields were looked at."""

    def __init__(self, hf: dict[str, Any], arch: str) -> None:
        self.hf, self.arch, self.defaults, self.used = hf, arch, DEFAULTS[arch], set()

    def get(self, key: str) -> Any:
        self.used.add(key)
        return self.hf.get(key, self.defaults[key])

    def positive_int(self, key: str, default: int | None = None) -> int:
        value = self.get(key)
        value = default if value is None else value
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"config.json: {key}={value!r} must be a positive integer.")
        return value

    def number(self, key: str) -> float:
        value = self.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"config.json: {key}={value!r} must be a non-negative number.")
        return float(value)

    def flag(self, key: str) -> bool:
        value = self.get(key)
        if not isinstance(value, bool):
            raise ValueError(f"config.json: {key}={value!r} must be true or false.")
        return value

    def require(self, key: str, supported: tuple, why: str) -> Any:
        value = self.get(key)
        if not any(value == s and type(value) is type(s) for s in supported):
            raise ValueError(f"config.json: {key}={value!r} is not supported by {self.arch} import ({why}); "
                             f"supported: {', '.join(repr(s) for s in supported)}.")
        return value

    def warn_unknown(self) -> None:
        unknown = sorted(set(self.hf) - self.used - _NOT_MATH)
        if unknown:
            warnings.warn(f"config.json fields {unknown} are unknown to the {self.arch} converter and were ignored: "
                          "check that they do not change the model.", UserWarning, stacklevel=3)


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of the model config.json describes (ValueError for anything it cannot express)."""
    arch = architecture_of(hf)
    fields = _Fields(hf, arch)
    cfg = _gpt2_to_model(fields) if FAMILY[arch] == "gpt2" else _llama_to_model(fields)
    fields.warn_unknown()
    return cfg


def _rope_theta(f: _Fields) -> float:
    """rope_theta from either format: v4 (rope_theta, rope_scaling) or v5 (rope_parameters)."""
    scaling, params = f.get("rope_scaling"), f.get("rope_parameters")
    source, rope = ("rope_scaling", scaling) if scaling else ("rope_parameters", params or {})
    if not isinstance(rope, dict):
        raise ValueError(f"config.json: {source}={rope!r} must be a mapping or null.")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"config.json: {source}={rope!r} is not supported: this model computes the default, "
                         "unscaled rotary embedding; only rope_scaling=null (rope_type 'default') is accepted.")
    theta, top_level = rope.get("rope_theta"), f.get("rope_theta")
    if theta is not None and "rope_theta" in f.hf and theta != top_level:
        raise ValueError(f"config.json: rope_theta={top_level!r} disagrees with {source}.rope_theta={theta!r}.")
    theta = top_level if theta is None else theta
    partial = rope.get("partial_rotary_factor", f.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config.json: partial_rotary_factor={partial!r} is not supported: rotary covers the "
                         "whole head dim here (1.0).")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ValueError(f"config.json: rope_theta={theta!r} must be a positive number.")
    return float(theta)


def _llama_to_model(f: _Fields) -> ModelConfig:
    h, nh = f.positive_int("hidden_size"), f.positive_int("num_attention_heads")
    head_dim = f.get("head_dim")
    if head_dim is None and h % nh != 0:
        raise ValueError(f"config.json: hidden_size={h} is not divisible by num_attention_heads={nh}; "
                         "set head_dim.")
    head_dim = f.positive_int("head_dim", h // nh)
    nkv = f.positive_int("num_key_value_heads", nh)
    f.require("hidden_act", ("silu", "swish"), "the MLP is SwiGLU: SiLU(gate) * up")
    mistral = f.arch == "MistralForCausalLM"
    max_seq_len = f.positive_int("max_position_embeddings")
    if mistral and f.get("sliding_window") is not None:
        # Within max_seq_len <= sliding_window no key ever falls out of the window: plain causal attention.
        max_seq_len = min(max_seq_len, f.positive_int("sliding_window"))
    if not mistral:
        f.positive_int("pretraining_tp", 1)  # only slices the same matmuls (identical math)
    attention_bias = False if mistral else f.flag("attention_bias")
    return ModelConfig(
        vocab_size=f.positive_int("vocab_size"), hidden_size=h, num_layers=f.positive_int("num_hidden_layers"),
        num_heads=nh, num_kv_heads=nkv, head_dim=None if head_dim * nh == h else head_dim,
        ffn_hidden_size=f.positive_int("intermediate_size"), activation="swiglu", norm="rmsnorm",
        norm_eps=f.number("rms_norm_eps"), position_embedding="rotary", max_seq_len=max_seq_len,
        rope_theta=_rope_theta(f), tie_embeddings=f.flag("tie_word_embeddings"), qkv_bias=attention_bias,
        out_bias=attention_bias, mlp_bias=False if mistral else f.flag("mlp_bias"), hidden_dropout=0.0,
        attention_dropout=f.number("attention_dropout"), init_std=f.number("initializer_range"),
    )


def _gpt2_to_model(f: _Fields) -> ModelConfig:
    h, nh = f.positive_int("n_embd"), f.positive_int("n_head")
    if h % nh != 0:
        raise ValueError(f"config.json: n_embd={h} is not divisible by n_head={nh}.")
    f.require("activation_function", ("gelu_new", "gelu_pytorch_tanh"), "the MLP's GELU is the tanh approximation")
    f.require("scale_attn_weights", (True,), "scores are scaled by 1/sqrt(head_dim)")
    f.require("scale_attn_by_inverse_layer_idx", (False,), "no per-layer score scaling")
    f.require("reorder_and_upcast_attn", (False,), "attention runs in the input dtype")
    f.require("add_cross_attention", (False,), "decoder-only, no cross-attention")
    resid, embd = f.number("resid_pdrop"), f.number("embd_pdrop")
    if resid != embd:
        raise ValueError(f"config.json: embd_pdrop={embd} differs from resid_pdrop={resid}: model.hidden_dropout "
                         "is one rate for both (dropout is training-only: set them equal in config.json).")
    return ModelConfig(
        vocab_size=f.positive_int("vocab_size"), hidden_size=h, num_layers=f.positive_int("n_layer"), num_heads=nh,
        ffn_hidden_size=f.positive_int("n_inner", 4 * h), activation="gelu", norm="layernorm",
        norm_eps=f.number("layer_norm_epsilon"), position_embedding="learned",
        max_seq_len=f.positive_int("n_positions"), tie_embeddings=f.flag("tie_word_embeddings"), qkv_bias=True,
        out_bias=True, mlp_bias=True,
        hidden_dropout=resid, attention_dropout=f.number("attn_pdrop"), init_std=f.number("initializer_range"),
    )


# ------------------------------------------------------------------------------------ export
def _misfits(cfg: ModelConfig, arch: str) -> list[str]:
    """What keeps `cfg` from being written as `arch` (empty: it can be)."""
    gpt2 = FAMILY[arch] == "gpt2"
    want = (("position_embedding", "learned"), ("norm", "layernorm"), ("activation", "gelu")) if gpt2 else \
        (("position_embedding", "rotary"), ("norm", "rmsnorm"), ("activation", "swiglu"))
    out = [f"{k}={getattr(cfg, k)!r} (needs {v!r})" for k, v in want if getattr(cfg, k) != v]
    if gpt2:
        out += [f"{k}=False (needs True)" for k in ("qkv_bias", "out_bias", "mlp_bias") if not getattr(cfg, k)]
        if cfg.num_kv_heads not in (None, cfg.num_heads):
            out.append(f"num_kv_heads={cfg.num_kv_heads} (needs num_heads={cfg.num_heads})")
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim not in (None, cfg.hidden_size // cfg.num_heads):
            out.append(f"head_dim={cfg.head_dim} (needs hidden_size / num_heads)")
    elif arch == "MistralForCausalLM":
        out += [f"{k}=True (needs False)" for k in ("qkv_bias", "out_bias", "mlp_bias") if getattr(cfg, k)]
    elif cfg.qkv_bias != cfg.out_bias:
        out.append(f"qkv_bias={cfg.qkv_bias} with out_bias={cfg.out_bias} (one attention_bias for both)")
    return out


def infer_architecture(cfg: ModelConfig) -> str:
    for arch in ("GPT2LMHeadModel", "LlamaForCausalLM"):
        if not _misfits(cfg, arch):
            return arch
    raise ValueError("this ModelConfig is neither GPT-2 nor Llama shaped: as GPT2LMHeadModel "
                     f"{_misfits(cfg, 'GPT2LMHeadModel')}; as LlamaForCausalLM {_misfits(cfg, 'LlamaForCausalLM')}.")


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
               initializer_range=cfg.init_std,
               # both spellings: transformers < 5 reads rope_theta/rope_scaling, >= 5 rope_parameters
               rope_theta=cfg.rope_theta, rope_scaling=None,
               rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    if arch == "MistralForCausalLM":
        return {**out, "sliding_window": None}
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
