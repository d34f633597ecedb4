"""What every check needs to know about this run, and the small model shapes it checks.

Sizes depend on p so that they are valid at any tensor-parallel size (heads divisible by p, k/v
heads dividing p or divisible by it), and are awkward on purpose (hidden 20, head dim 6, vocabulary
203) so that a transposed or mis-sliced dimension cannot pass by accident.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tensor_parallel.parallel_state import ProcessGroup
from ..transformer import ModelConfig

HIDDEN, HEAD_DIM, VOCAB, BATCH = 20, 6, 203, 2


@dataclass(frozen=True)
class CheckContext:
    device: torch.device
    dtype: torch.dtype
    tp_size: int
    tp_rank: int
    tp_group: ProcessGroup | None
    dp_group: ProcessGroup | None
    solo_group: ProcessGroup  # this rank alone: builds the p = 1 reference models
    global_rank: int
    world_size: int
    seed: int
    fault: str | None  # "replica", "layout" or None (testing the tool itself)


def seq_len(p: int) -> int:
    """Divisible by p (sequence parallelism needs it), never a power of two at p <= 2."""
    return 3 * p if p > 1 else 5


def attention_cases(p: int) -> dict[str, tuple[dict, bool]]:
    """name -> (AttentionConfig arguments, whether to pass a key-padding mask)."""
    gqa_kv_heads = 2 if p == 1 or p % 2 == 0 else 1  # p = 2: one k/v head per rank; p >= 4: replicas
    common = dict(hidden_size=HIDDEN, head_dim=HEAD_DIM)
    return {
        "mha": (dict(common, num_heads=2 * p, num_kv_heads=2 * p), False),
        "gqa": (dict(common, num_heads=4 * p, num_kv_heads=gqa_kv_heads, rotary=True), True),
        "mqa": (dict(common, num_heads=2 * p, num_kv_heads=1, qkv_bias=False), False),  # p > 1: k/v replicas
    }


def model_configs(p: int) -> dict[str, ModelConfig]:
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2, num_heads=2 * p, head_dim=HEAD_DIM,
                  ffn_hidden_size=12 * p, max_seq_len=seq_len(p))
    return {
        "gpt2-like": ModelConfig(**common),
        "llama-like": ModelConfig(**common, num_kv_heads=1, activation="swiglu", norm="rmsnorm",
                                  position_embedding="rotary", tie_embeddings=False, qkv_bias=False,
                                  out_bias=False, mlp_bias=False),
    }


def my_chunk(x: torch.Tensor, ctx: CheckContext, sequence_parallel: bool) -> torch.Tensor:
    """This rank's [s/p, ...] chunk under sequence parallelism, else the whole tensor."""
    return x.chunk(ctx.tp_size, dim=0)[ctx.tp_rank] if sequence_parallel else x
