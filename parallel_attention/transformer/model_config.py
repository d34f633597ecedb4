"""ModelConfig: the whole GPT model's shape, p-independent, as saved in run configs and checkpoints.

It lives with the model (the `model:` section of a run config is this dataclass), so that the
transformer, checkpointing and Hugging Face layers use it without importing `training/`.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .attention_config import AttentionConfig
from .rotary import RopeScaling


@dataclass
class ModelConfig:
    vocab_size: int = 256  # the byte-level tokenizer; padded to a multiple of 64 p inside the model
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_hidden_size: int | None = None  # None: 4h (gelu) or 8h/3 rounded up to 64 (swiglu)
    activation: Literal["gelu", "swiglu"] = "gelu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    position_embedding: Literal["learned", "rotary"] = "learned"
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    qkv_bias: bool = True
    out_bias: bool = True
    mlp_bias: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # per_rank: dropout from the tensor-parallel generator (fast; masks depend on the layout);
    # layout_invariant: masks hashed from (seed, step, sample, layer, head/channel, position)
    dropout_rng: Literal["per_rank", "layout_invariant"] = "per_rank"
    init_std: float = 0.02
    recompute_activations: bool = False
    # what recompute_activations recomputes: the whole layer (keeps its input only) or the attention core
    # softmax(q k^T) v (keeps the projections' outputs); runtime-only, like dropout
    recompute_granularity: Literal["full", "selective"] = "full"
    compile: bool = False  # torch.compile (inductor) each transformer layer; runtime-only, like dropout
    attention_kernel: Literal["auto", "sdpa", "math", "apex"] = "auto"
    # rotary frequency scaling (rotary.py): "default" none; "llama3" Llama 3.1's, with the four numbers below
    rope_type: Literal["default", "llama3"] = "default"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192  # the context length the unscaled model was trained at
    qk_norm: bool = False  # RMSNorm (eps norm_eps) over each head's q and k before rotary, as Qwen3

    # keys renamed since 0.1.0: still read (configs and checkpoints in users' hands), with a warning
    RENAMED = {"attention_backend": "attention_kernel"}
    # keys added since: a config or checkpoint written without them meant their defaults (read as such)
    ADDED = ("rope_type", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
             "rope_original_max_seq_len", "qk_norm")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """The `model` section as saved in a run config or checkpoint manifest (renamed keys accepted)."""
        data = migrate_renamed_keys(cls, data, "model", warn=False)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown model config key(s) {unknown}; known: {sorted(names)}.")
        return cls(**data)

    def attention_config(self, params_dtype: torch.dtype = torch.float32) -> AttentionConfig:
        """The attention block's shape (its layout, sequence parallelism included, is ParallelSelfAttention's)."""
        return AttentionConfig(
            hidden_size=self.hidden_size, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, qkv_bias=self.qkv_bias, out_bias=self.out_bias,
            attention_dropout=self.attention_dropout, dropout_rng=self.dropout_rng, causal=True,
            rotary=self.position_embedding == "rotary", rope_theta=self.rope_theta,
            init_std=self.init_std, attention_kernel=self.attention_kernel, params_dtype=params_dtype,
            rope_scaling=self.rope_scaling(), qk_norm=self.qk_norm, qk_norm_eps=self.norm_eps,
        )

    def rope_scaling(self) -> RopeScaling | None:
        """The rotary frequency scaling the rope_* fields describe (None: rope_type 'default')."""
        if self.rope_type == "default":
            return None
        return RopeScaling(self.rope_type, self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                           self.rope_original_max_seq_len)

    def resolved_ffn_hidden_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            return 64 * -(-(8 * self.hidden_size // 3) // 64)
        return 4 * self.hidden_size


def migrate_renamed_keys(cls, data: dict[str, Any], section: str, warn: bool = True) -> dict[str, Any]:
    """`data` with the keys that `cls.ADDED` lists at their defaults where absent, the keys that `cls.RENAMED`
    lists under their new names (both at once is an error), and without the keys `cls.REMOVED` lists: accepted at
    the value that behaves as if the key were absent (with a FutureWarning), refused at any other value."""
    added = [name for name in getattr(cls, "ADDED", ()) if isinstance(data, dict) and name not in data]
    if added:
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        data = {**data, **{name: defaults[name] for name in added}}
    renamed, removed = getattr(cls, "RENAMED", {}), getattr(cls, "REMOVED", {})
    if not isinstance(data, dict) or not (renamed.keys() | removed.keys()) & data.keys():
        return data
    data = dict(data)
    for old, new in renamed.items():
        if old not in data:
            continue
        if new in data:
            raise ValueError(f"{section}.{old} and {section}.{new} are both set: {section}.{old} is the old "
                             f"name of {section}.{new}; keep only {section}.{new}.")
        if warn:
            warnings.warn(f"config key {section}.{old} is deprecated: call it {section}.{new}.", FutureWarning,
                          stacklevel=3)
        data[new] = data.pop(old)
    for key, neutral in removed.items():
        if key not in data:
            continue
        value = data.pop(key)
        if value != neutral:
            raise ValueError(f"{section}.{key}={value!r}: the key was removed in 0.2; only {section}.{key}="
                             f"{neutral!r}, which changes nothing, is still read: drop the key.")
        if warn:
            warnings.warn(f"config key {section}.{key} was removed in 0.2 and is ignored: drop it.", FutureWarning,
                          stacklevel=3)
    return data
