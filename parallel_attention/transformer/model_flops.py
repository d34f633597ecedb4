"""The model's FLOPs per token, part by part: what MFU counts and what the pipeline split weighs.

Model FLOPs (MFU's numerator, as in Megatron-LM and PaLM) count the matrix multiplications the model
needs, not what the hardware happens to run: activation recompute and the vocabulary padding are not
counted, and neither are norms, biases, activations, softmax or the embedding lookup.

    flops per token = 6 N + 12 L (nh d) s

- N: the weights of every matrix multiplication a token goes through: per layer the fused QKV projection
  h (nh + 2 nkv) d, the output projection nh d h and the MLP (2 h f with gelu, 3 h f with SwiGLU), plus
  the output layer h V (counted even when tied to the embedding: its matmul runs either way). Embedding
  tables (tokens, learned positions), norms and biases are not in N.
- 6: 2 FLOPs per multiply-add forward, 4 backward (input and weight gradients).
- 12 L (nh d) s: attention scores QK^T and the weighted sum AV, 2 s nh d FLOPs each forward per token,
  times 3 for forward + backward. Causal masking would halve the work a fused kernel does; like Megatron
  and PaLM we do not halve, so MFU figures compare with theirs.

A pipeline stage's cost adds what model FLOPs leave out but a stage still runs: the loss's softmax over the
vocabulary (`loss_flops_per_token`) and the embedding's lookup and gradient (`embedding_flops_per_token`).
"""

from __future__ import annotations

from .model_config import ModelConfig


def layer_matmul_weights(cfg: ModelConfig) -> int:
    """One transformer layer's share of N: the fused QKV and output projections and the MLP."""
    h, nh = cfg.hidden_size, cfg.num_heads
    nkv, d = cfg.num_kv_heads or nh, cfg.head_dim or cfg.hidden_size // nh
    attention = h * (nh + 2 * nkv) * d + nh * d * h
    return attention + (3 if cfg.activation == "swiglu" else 2) * h * cfg.resolved_ffn_hidden_size()


def matmul_weights(cfg: ModelConfig) -> int:
    """N above: weights of the per-token matrix multiplications (the output layer included)."""
    return cfg.num_layers * layer_matmul_weights(cfg) + cfg.hidden_size * cfg.vocab_size


def layer_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """One layer's training (forward + backward) model FLOPs per token: its matmuls and its attention scores."""
    nh, d = cfg.num_heads, cfg.head_dim or cfg.hidden_size // cfg.num_heads
    return 6 * layer_matmul_weights(cfg) + 12 * nh * d * seq_len


def output_layer_flops_per_token(cfg: ModelConfig) -> int:
    """The output layer's training model FLOPs per token (h V weights, tied or not)."""
    return 6 * cfg.hidden_size * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training (forward + backward) model FLOPs per token at sequence length `seq_len`."""
    return cfg.num_layers * layer_flops_per_token(cfg, seq_len) + output_layer_flops_per_token(cfg)


def loss_flops_per_token(cfg: ModelConfig) -> int:
    """The cross entropy over V logits, forward and backward: about 6 element-wise operations per logit (max,
    subtract, exp and sum forward; the softmax and its difference from the one-hot target backward)."""
    return 6 * cfg.vocab_size


def embedding_flops_per_token(cfg: ModelConfig) -> int:
    """The embedding: a row copied forward and added into the table's gradient backward (h each), the same again
    for learned positions."""
    return 2 * cfg.hidden_size * (2 if cfg.position_embedding == "learned" else 1)
