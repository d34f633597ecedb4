"""ModelConfig: the whole GPT model's shape, p-independent, as saved in run configs and checkpoints.

It lives with the model (the `model:` section of a run config is this dataclass), so that the
transformer, checkpointing and Hugging Face layers use it without importing `training/`.
"""

from __future__ import annotations

import dataclasses
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
    qk_norm: bool = False  # RMSNorm (eps norm_eps) over q and k before rotary: Qwen3, OLMoE
    # what one q/k norm spans: "head" each head's d values (Qwen3, weights [d]); "projection" the whole q and k
    # projections (OLMoE, weights [nh d] and [nkv d]; under tensor parallelism summed over the ranks)
    qk_norm_scope: Literal["head", "projection"] = "head"
    # mixture of experts (docs/moe.md); num_experts 0 keeps every layer's MLP dense
    num_experts: int = 0
    moe_top_k: int = 2  # experts per token
    moe_ffn_hidden_size: int | None = None  # each expert's FFN width; None: the dense ffn_hidden_size
    moe_shared_expert_ffn_hidden_size: int = 0  # an always-on expert beside the routed ones (0: none)
    moe_shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert's output times sigmoid(x w), w [1, h]
    moe_router_score: Literal["softmax", "sigmoid"] = "softmax"  # Mixtral, Qwen: softmax; DeepSeek-V3: sigmoid
    moe_router_renormalize: bool = True  # the top-k probabilities divided by their sum
    # DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores for the choice only,
    # moved by this much against each expert's excess load after every step (0: no bias)
    moe_router_bias_update_rate: float = 0.0
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss (Switch / GShard form)
    moe_z_loss_coeff: float = 0.0  # router z-loss (ST-MoE): mean logsumexp(logits)^2
    moe_layer_freq: int = 1  # layer i is MoE when (i + 1) % moe_layer_freq == 0 (Qwen2-MoE decoder_sparse_step)
    moe_first_dense_layers: int = 0  # the first k layers stay dense (DeepSeek first_k_dense_replace)
    moe_capacity_factor: float | None = None  # null: dropless; f: each expert takes ceil(f T k / E) of T tokens

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """The `model` section as this release saves it in a run config or checkpoint manifest (one written by an
        older release is read through parallel_attention.checkpointing.compatibility, which every load path calls)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown model config key(s) {unknown}; known: {sorted(names)} (a section written by "
                             "an older release: read it through checkpointing.compatibility.upgrade_section).")
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
            qk_norm_scope=self.qk_norm_scope,
        )

    def rope_scaling(self) -> RopeScaling | None:
        """The rotary frequency scaling the rope_* fields describe (None: rope_type 'default')."""
        if self.rope_type == "default":
            return None
        return RopeScaling(self.rope_type, self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                           self.rope_original_max_seq_len)

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (global, from 0) has a mixture of experts instead of the dense MLP."""
        return (self.num_experts > 0 and index >= self.moe_first_dense_layers
                and (index + 1) % self.moe_layer_freq == 0)

    def resolved_moe_ffn_hidden_size(self) -> int:
        """Each routed expert's FFN width."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.resolved_ffn_hidden_size()

    def resolved_ffn_hidden_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            return 64 * -(-(8 * self.hidden_size // 3) // 64)
        return 4 * self.hidden_size

