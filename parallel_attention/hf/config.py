"""Hugging Face `config.json` <-> ModelConfig, for the families this model can express exactly.

    Llama family  LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM: rotary over the
                  whole head (rotate-half form; rope_type default or llama3), RMSNorm, SwiGLU, grouped-query
                  attention, no hidden dropout; the biases and q/k norms of each are in `family_tables`,
                  the architectures in `families`
    GPT-2         GPT2LMHeadModel: learned positions, LayerNorm with bias, GELU (tanh form), biases everywhere

Reading is explicit: every field that changes the forward is either mapped to a ModelConfig field or
checked to hold the one value this model computes (else a ValueError names the field, its value and
what is supported). A field absent from config.json takes the Hugging Face class default, as
`from_pretrained` would. Fields known not to change the forward (token ids, bookkeeping) are ignored;
any other field draws a warning naming it. The rotary fields are read by `rope_config`.

Writing (`export_config`) inverts the mapping.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from ..checkpointing.tensor_io import size_of
from ..transformer.model_config import ModelConfig
from .export_config import hf_config_from_model, infer_architecture
from .families import DEFAULTS, FAMILY, MODEL_TYPE, architecture_of
from .family_tables import CARRIED, NOT_MATH
from .rope_config import rope_from_hf

__all__ = ["CARRIED", "DEFAULTS", "FAMILY", "MODEL_TYPE", "architecture_of", "hf_config_from_model",
           "infer_architecture", "model_config_from_hf", "read_hf_config", "read_json_object"]

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
        unknown = sorted(set(self.hf) - self.used - NOT_MATH)
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


def _llama_to_model(f: _Fields) -> ModelConfig:
    h, nh = f.positive_int("hidden_size"), f.positive_int("num_attention_heads")
    head_dim = f.get("head_dim")
    if head_dim is None and h % nh != 0:
        raise ValueError(f"config.json: hidden_size={h} is not divisible by num_attention_heads={nh}; "
                         "set head_dim.")
    head_dim = f.positive_int("head_dim", h // nh)
    nkv = f.positive_int("num_key_value_heads", nh)
    f.require("hidden_act", ("silu", "swish"), "the MLP is SwiGLU: SiLU(gate) * up")
    max_seq_len = f.positive_int("max_position_embeddings")
    window = _sliding_window(f)
    if window is not None:
        # Within max_seq_len <= sliding_window no key ever falls out of the window: plain causal attention.
        max_seq_len = min(max_seq_len, window)
    if f.arch == "LlamaForCausalLM":
        f.positive_int("pretraining_tp", 1)  # only slices the same matmuls (identical math)
    experts = _experts(f) if f.arch in MOE_ARCHITECTURES else {}
    return ModelConfig(
        vocab_size=f.positive_int("vocab_size"), hidden_size=h, num_layers=f.positive_int("num_hidden_layers"),
        num_heads=nh, num_kv_heads=nkv, head_dim=None if head_dim * nh == h else head_dim,
        ffn_hidden_size=f.positive_int("intermediate_size"), activation="swiglu", norm="rmsnorm",
        norm_eps=f.number("rms_norm_eps"), position_embedding="rotary", max_seq_len=max_seq_len,
        tie_embeddings=f.flag("tie_word_embeddings"), hidden_dropout=0.0,
        attention_dropout=f.number("attention_dropout"), init_std=f.number("initializer_range"),
        **rope_from_hf(f), **_attention_variant(f), **experts,
    )


MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")


def _experts(f: _Fields) -> dict[str, Any]:
    """The mixture of experts of Mixtral (every layer, top-k renormalised), OLMoE (every layer, norm_topk_prob) and
    Qwen2/3-MoE (norm_topk_prob, a layer every decoder_sparse_step, the first layers dense through mlp_only_layers;
    Qwen2-MoE's gated shared expert)."""
    if f.arch in ("MixtralForCausalLM", "OlmoeForCausalLM"):  # intermediate_size is the experts' width
        mixtral = f.arch == "MixtralForCausalLM"
        return dict(num_experts=f.positive_int("num_local_experts" if mixtral else "num_experts"),
                    moe_top_k=f.positive_int("num_experts_per_tok"),
                    moe_ffn_hidden_size=f.positive_int("intermediate_size"),
                    moe_router_renormalize=True if mixtral else f.flag("norm_topk_prob"),
                    moe_aux_loss_coeff=f.number("router_aux_loss_coef"))
    count_key = "num_local_experts" if f.hf.get("num_local_experts") is not None else "num_experts"
    dense = f.get("mlp_only_layers") or []
    if dense != list(range(len(dense))):
        raise ValueError(f"config.json: mlp_only_layers={dense!r} is not supported: the dense layers must be the first "
                         "k layers (model.moe_first_dense_layers).")
    out = dict(num_experts=f.positive_int(count_key), moe_top_k=f.positive_int("num_experts_per_tok"),
               moe_ffn_hidden_size=f.positive_int("moe_intermediate_size"),
               moe_router_renormalize=f.flag("norm_topk_prob"), moe_aux_loss_coeff=f.number("router_aux_loss_coef"),
               moe_layer_freq=f.positive_int("decoder_sparse_step"), moe_first_dense_layers=len(dense))
    if f.arch == "Qwen2MoeForCausalLM":
        out.update(moe_shared_expert_ffn_hidden_size=f.positive_int("shared_expert_intermediate_size"),
                   moe_shared_expert_gate=True)
    return out


def _attention_variant(f: _Fields) -> dict[str, bool]:
    """The biases and q/k norms each architecture has (see family_tables)."""
    arch = f.arch
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return dict(qkv_bias=False, out_bias=False, mlp_bias=False)
    if arch == "Qwen2ForCausalLM":
        return dict(qkv_bias=True, out_bias=False, mlp_bias=False)
    if arch == "Qwen2MoeForCausalLM":
        return dict(qkv_bias=f.flag("qkv_bias"), out_bias=False, mlp_bias=False)
    bias = f.flag("attention_bias")
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        return dict(qkv_bias=bias, out_bias=bias, mlp_bias=False, qk_norm=True)
    if arch == "OlmoeForCausalLM":
        f.require("clip_qkv", (None,), "q, k and v are not clamped")
        f.require("head_dim", (None,), "OLMoE's q norm spans hidden_size values: head_dim is hidden_size / heads")
        return dict(qkv_bias=bias, out_bias=bias, mlp_bias=False, qk_norm=True, qk_norm_scope="projection")
    return dict(qkv_bias=bias, out_bias=bias, mlp_bias=f.flag("mlp_bias"))


def _sliding_window(f: _Fields) -> int | None:
    """The sliding window some layer uses (None: every layer attends the whole causal prefix).

    Mistral: sliding_window. Qwen2/3: sliding_window if use_sliding_window, on the layers that layer_types marks
    'sliding_attention' (or, without layer_types, on those from max_window_layers on)."""
    if f.arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return None if f.get("sliding_window") is None else f.positive_int("sliding_window")
    if f.arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return None
    enabled, window = f.flag("use_sliding_window"), f.get("sliding_window")  # the window counts only if enabled
    window = f.positive_int("sliding_window") if enabled and window is not None else None
    layers, types = f.positive_int("num_hidden_layers"), f.get("layer_types")
    start = f.get("max_window_layers")
    if types is None:
        types = ["sliding_attention" if window is not None and i >= start else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or \
            not set(types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"config.json: layer_types={types!r} must list 'full_attention' or 'sliding_attention' "
                         f"for each of the num_hidden_layers={layers} layers.")
    if "sliding_attention" not in types:
        return None
    if window is None:
        raise ValueError("config.json: layer_types marks sliding_attention layers but sliding_window is null "
                         "(or use_sliding_window false): set sliding_window.")
    return window


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
