"""AttentionConfig: the global (p-independent) description of one attention block: its shape.

The config always describes the whole model; per-rank sizes are derived from it for a given
tensor-parallel size p by `per_rank_heads`, never written back into it. The layout (sequence parallelism,
communication overlap) is ParallelSelfAttention's, not the block's: the keywords that held it before 0.2 are
refused by name, with the argument that replaces each (`REMOVED_ARGUMENTS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels.apex_kernels import apex_available
from .rotary import RopeScaling

# auto: the chunked causal kernel on CPU (kernels/causal_chunks.py), SDPA elsewhere; sdpa: one SDPA call everywhere
ATTENTION_KERNELS = ("auto", "sdpa", "math", "apex")
DROPOUT_RNGS = ("per_rank", "layout_invariant")
# what one q/k norm spans: each head's d values (Qwen3, weight [d]) or the whole projection (OLMoE, weights [nh d]
# and [nkv d], sharded like the heads: under tensor parallelism its mean square is summed over the ranks)
QK_NORM_SCOPES = ("head", "projection")
# keywords AttentionConfig took before 0.2 (accepted with a FutureWarning in 0.2, removed in 0.3): what replaces each
REMOVED_ARGUMENTS = {
    "sequence_parallel": "pass sequence_parallel= to ParallelSelfAttention (or GPTModel) instead",
    "overlap_comm": "pass overlap_comm= to ParallelSelfAttention (or GPTModel) instead",
    "backend": "pass attention_kernel= instead",
    "comm_chunks": "drop it: every row-parallel linear issues one collective",
}


@dataclass
class AttentionConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int | None = None  # None: num_heads (multi-head); 1: multi-query
    head_dim: int | None = None  # None: hidden_size // num_heads
    qkv_bias: bool = True
    out_bias: bool = True
    attention_dropout: float = 0.0
    dropout_rng: str = "per_rank"  # per_rank (tensor-parallel generator) or layout_invariant (hashed)
    causal: bool = True
    rotary: bool = False
    rope_theta: float = 10000.0
    init_std: float = 0.02
    params_dtype: torch.dtype = torch.float32
    attention_kernel: str = "auto"  # auto, sdpa, math or apex (ATTENTION_KERNELS)
    rope_scaling: RopeScaling | None = None  # rotary frequency scaling (None: unscaled)
    qk_norm: bool = False  # RMSNorm over each head's q and k before rotary (Qwen3); weights [d], shared by the heads
    qk_norm_eps: float = 1e-6
    qk_norm_scope: str = "head"  # QK_NORM_SCOPES: each head's q and k, or the whole q and k projections (OLMoE)

    def __new__(cls, *args, **kwargs):
        """Refuse a keyword of before 0.2 by name, with what replaces it (the dataclass's __init__ takes the rest)."""
        removed = [f"AttentionConfig({name}=...) was removed in 0.3: {REMOVED_ARGUMENTS[name]}" for name in kwargs
                   if name in REMOVED_ARGUMENTS]
        if removed:
            raise TypeError("; ".join(removed) + ".")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        self._resolve_heads()
        self._check_settings()

    def _resolve_heads(self) -> None:
        """Check the sizes; fill num_kv_heads and head_dim when left None."""
        for name in ("hidden_size", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AttentionConfig: {name}={value!r} must be a positive integer.")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if not isinstance(self.num_kv_heads, int) or self.num_kv_heads < 1:
            raise ValueError(f"AttentionConfig: num_kv_heads={self.num_kv_heads!r} must be a positive integer.")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"AttentionConfig: num_heads={self.num_heads} is not divisible by "
                f"num_kv_heads={self.num_kv_heads}: each key/value head serves a whole group of query "
                "heads, so choose num_kv_heads among the divisors of num_heads."
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads != 0:
                raise ValueError(
                    f"AttentionConfig: hidden_size={self.hidden_size} is not divisible by "
                    f"num_heads={self.num_heads}: set head_dim explicitly or change num_heads."
                )
            self.head_dim = self.hidden_size // self.num_heads
        if not isinstance(self.head_dim, int) or self.head_dim < 1:
            raise ValueError(f"AttentionConfig: head_dim={self.head_dim!r} must be a positive integer.")

    def _check_settings(self) -> None:
        if self.rotary and self.head_dim % 2 != 0:
            raise ValueError(
                f"AttentionConfig: rotary=True needs an even head_dim, got head_dim={self.head_dim}."
            )
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(
                f"AttentionConfig: attention_dropout={self.attention_dropout!r} must lie in [0, 1)."
            )
        if self.dropout_rng not in DROPOUT_RNGS:
            raise ValueError(
                f"AttentionConfig: dropout_rng={self.dropout_rng!r} is unknown; choose one of {', '.join(DROPOUT_RNGS)}."
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"AttentionConfig: rope_scaling={self.rope_scaling!r} must be a RopeScaling or None.")
        if not self.qk_norm_eps > 0:
            raise ValueError(f"AttentionConfig: qk_norm_eps={self.qk_norm_eps!r} must be positive.")
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"AttentionConfig: qk_norm_scope={self.qk_norm_scope!r} is unknown; choose one of "
                             f"{', '.join(QK_NORM_SCOPES)}.")
        if not self.rope_theta > 0:
            raise ValueError(f"AttentionConfig: rope_theta={self.rope_theta!r} must be positive.")
        if not self.init_std > 0:
            raise ValueError(f"AttentionConfig: init_std={self.init_std!r} must be positive.")
        if not isinstance(self.params_dtype, torch.dtype) or not self.params_dtype.is_floating_point:
            raise ValueError(
                f"AttentionConfig: params_dtype={self.params_dtype!r} must be a floating torch.dtype "
                "such as torch.float32 or torch.bfloat16."
            )
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"AttentionConfig: attention_kernel={self.attention_kernel!r} is unknown; choose one of "
                f"{', '.join(ATTENTION_KERNELS)}."
            )
        if self.attention_kernel == "apex" and not apex_available():
            raise ValueError(
                "AttentionConfig: attention_kernel='apex' but NVIDIA apex is not installed (it is not on PyPI; "
                "it ships in NGC containers or builds from github.com/NVIDIA/apex): use attention_kernel='auto'."
            )

    def per_rank_heads(self, tp_size: int) -> tuple[int, int]:
        """(num_heads_per_rank, num_kv_heads_per_rank) at tensor-parallel size `tp_size`.

        When tp_size > num_kv_heads each rank keeps a replica of the one k/v head its queries use.
        """
        p, nh, nkv = tp_size, self.num_heads, self.num_kv_heads
        if nh % p != 0:
            raise ValueError(
                f"num_heads={nh} is not divisible by tensor_parallel_size={p}: each rank must own whole "
                f"heads; choose a tensor-parallel size that divides {nh}."
            )
        if p <= nkv:
            if nkv % p != 0:
                raise ValueError(
                    f"num_kv_heads={nkv} is not divisible by tensor_parallel_size={p}: choose a "
                    f"tensor-parallel size that divides {nkv}, or a multiple of it."
                )
            return nh // p, nkv // p
        if p % nkv != 0:
            raise ValueError(
                f"tensor_parallel_size={p} is larger than num_kv_heads={nkv} but not a multiple of it: "
                f"the k/v heads can only be replicated evenly; choose a multiple of {nkv} or a divisor of it."
            )
        return nh // p, 1

    def qk_norm_widths(self) -> tuple[int, int]:
        """The q and k norms' weight sizes: (d, d) per head, (nh d, nkv d) over the projections, (0, 0) without."""
        if not self.qk_norm:
            return 0, 0
        if self.qk_norm_scope == "head":
            return self.head_dim, self.head_dim
        return self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim

