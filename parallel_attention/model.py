"""GPT model on the tensor-parallel layers: embedding, pre-norm transformer layers, vocab-parallel loss.

    tokens [b, s] -> transpose -> [s, b]
      | VocabParallelEmbedding (+ learned positions)       -> [s, b, h]  (SP: [s/p, b, h])
      | TransformerLayer x L: x + drop(attn(norm(x))); x + drop(mlp(norm(x)))
      | final norm
      | output layer (tied to the embedding, or its own ColumnParallelLinear) -> logits [s, b, V/p]
      | vocab_parallel_cross_entropy: the full logits are never gathered
    loss (mean over tokens)

Dropout on activations replicated across the tensor-parallel group draws from the default
generator (identical on every rank); under sequence parallelism each rank holds other tokens,
so it draws from the tensor-parallel generator instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import mappings, sharding
from .attention import ParallelSelfAttention
from .config import ModelConfig
from .cross_entropy import vocab_parallel_cross_entropy
from .grads import PartialGrad
from .kv_cache import KVCache
from .layers import ColumnParallelLinear, VocabParallelEmbedding
from .mlp import ParallelMLP
from .model_sharding import canonical_sources, padded_vocab_size, shard_state_dict, unshard
from .norms import build_norm
from .parallel_state import ProcessGroup, group_rank, group_size, resolve_tp_group
from .random import checkpoint_with_tp_rng, tensor_parallel_rng


def _dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool) -> torch.Tensor:
    if p == 0 or not training:
        return x
    if sequence_parallel:
        with tensor_parallel_rng(x.device):
            return F.dropout(x, p, training=True)
    return F.dropout(x, p, training=True)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + dropout(attention(norm(x))), then x + dropout(mlp(norm(x)))."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, tp_group: ProcessGroup | None, device, dtype):
        super().__init__()
        norm = lambda: build_norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, sequence_parallel,  # noqa: E731
                                  tp_group, device, dtype)
        self.hidden_dropout, self.sequence_parallel = cfg.hidden_dropout, sequence_parallel
        self.input_norm = norm()
        self.attention = ParallelSelfAttention(cfg.attention_config(sequence_parallel), tp_group, device)
        self.post_attention_norm = norm()
        self.mlp = ParallelMLP(cfg.hidden_size, cfg.resolved_ffn_hidden_size(), cfg.activation, cfg.mlp_bias,
                               sequence_parallel, cfg.init_std, tp_group, device, dtype)

    def forward(self, x: torch.Tensor, kv_cache=None) -> torch.Tensor:
        drop = lambda t: _dropout(t, self.hidden_dropout, self.training, self.sequence_parallel)  # noqa: E731
        x = x + drop(self.attention(self.input_norm(x), kv_cache=kv_cache))
        return x + drop(self.mlp(self.post_attention_norm(x)))


class GPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig, sequence_parallel: bool = False, tp_group: ProcessGroup | None = None,
                 device=None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.sequence_parallel = cfg, sequence_parallel
        self.tp_group = resolve_tp_group(tp_group)
        self.tp_size, self.tp_rank = group_size(self.tp_group), group_rank(self.tp_group)
        self.vocab_size = cfg.vocab_size
        self.padded_vocab_size = padded_vocab_size(cfg.vocab_size, self.tp_size)
        h, std = cfg.hidden_size, cfg.init_std
        # Construction order is the order the seeded generator is drawn in: it must not depend on p.
        self.embed_tokens = VocabParallelEmbedding(self.padded_vocab_size, h, init_method=None,
                                                   sequence_parallel=sequence_parallel, tp_group=self.tp_group,
                                                   device=device, dtype=dtype)
        self._load_vocab_rows(self.embed_tokens.weight, self._normal((cfg.vocab_size, h), std, device, dtype))
        self.embed_positions = None
        if cfg.position_embedding == "learned":
            self.embed_positions = nn.Parameter(self._normal((cfg.max_seq_len, h), std, device, dtype))
        self.layers = nn.ModuleList(TransformerLayer(cfg, sequence_parallel, self.tp_group, device, dtype)
                                    for _ in range(cfg.num_layers))
        self.final_norm = build_norm(cfg.norm, h, cfg.norm_eps, sequence_parallel, self.tp_group, device, dtype)
        self.lm_head = None
        if not cfg.tie_embeddings:
            self.lm_head = ColumnParallelLinear(h, self.padded_vocab_size, bias=False,
                                                sequence_parallel=sequence_parallel, init_method=None,
                                                tp_group=self.tp_group, device=device, dtype=dtype)
            self._load_vocab_rows(self.lm_head.weight, self._normal((cfg.vocab_size, h), std, device, dtype))

    @staticmethod
    def _normal(shape, std, device, dtype) -> torch.Tensor:
        return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std)

    @torch.no_grad()
    def _load_vocab_rows(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """Copy this rank's rows of a full [V, h] table, padding rows past V with zeros."""
        shard.copy_(sharding.vocab_shard(full, self.padded_vocab_size, self.tp_size, self.tp_rank))

    def partial_grads(self) -> list[PartialGrad]:
        """Under SP each rank adds only its own positions' gradient to the learned position table."""
        if self.sequence_parallel and self.embed_positions is not None and self.tp_size > 1:
            return [PartialGrad(self.embed_positions, self.tp_group)]
        return []

    # ------------------------------------------------------------------------------ forward
    def new_kv_cache(self, batch_size: int, max_len: int) -> KVCache:
        attn = self.layers[0].attention
        return KVCache(len(self.layers), batch_size, attn.num_kv_heads_per_rank, attn.config.head_dim, max_len,
                       device=self.final_norm.weight.device, dtype=self.final_norm.weight.dtype)

    def _embed(self, tokens: torch.Tensor, offset: int) -> torch.Tensor:
        s = tokens.shape[1]
        if s + offset > self.config.max_seq_len:
            raise ValueError(f"sequence of {s + offset} tokens exceeds model.max_seq_len={self.config.max_seq_len}.")
        x = self.embed_tokens(tokens.t())  # [s, b, h]; SP: [s/p, b, h]
        if self.embed_positions is not None:
            positions = self.embed_positions[offset:offset + s]
            if self.sequence_parallel:
                positions = positions.chunk(self.tp_size, dim=0)[self.tp_rank]
            x = x + positions.unsqueeze(1)
        return _dropout(x, self.config.hidden_dropout, self.training, self.sequence_parallel)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits, [s, b, V_padded/p]."""
        if self.lm_head is not None:
            return self.lm_head(x)
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = mappings.copy_to_tensor_parallel_region(x, self.tp_group)
        return F.linear(x, self.embed_tokens.weight)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """tokens [b, s] -> mean loss over labels [b, s], or local logits [s, b, V_padded/p] without labels."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [b, s], got shape {tuple(tokens.shape)}.")
        x = self._embed(tokens, 0 if kv_cache is None else kv_cache.length)
        recompute = self.config.recompute_activations and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            if recompute:
                x = checkpoint_with_tp_rng(layer, x)
            else:
                x = layer(x, kv_cache=None if kv_cache is None else kv_cache.layers[i])
        if kv_cache is not None:
            kv_cache.advance(tokens.shape[1])
        logits = self._logits(self.final_norm(x))
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels.t(), self.vocab_size, self.tp_group).mean()

    @torch.no_grad()
    def next_token_logits(self, tokens: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Full-vocabulary logits [b, V] of the last position (gathers across the group)."""
        local = self.forward(tokens, kv_cache=kv_cache)[-1]
        return mappings.gather_from_tensor_parallel_region(local, self.tp_group)[:, :self.vocab_size].float()

    # ------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def canonical_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, p-independent weights on every rank (a collective over the tensor-parallel group)."""
        canonical = {}
        for key, local in self.state_dict().items():
            kind = canonical_sources(self.config, key)[0]
            if kind == "replicated":
                shards = [local] * self.tp_size
            else:
                dim = 1 if kind == "row" else 0
                shards = list(mappings.all_gather_along_dim(local, dim, self.tp_group).chunk(self.tp_size, dim))
            canonical.update({k: v.clone() for k, v in unshard(self.config, key, shards).items()})
        return canonical

    @torch.no_grad()
    def load_canonical_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load full weights (as canonical_state_dict returns them); each rank keeps its shard."""
        sharding.check_canonical(sd, self.canonical_shapes(), "model canonical state dict")
        local = self.state_dict()
        sd = {k: v.to(device=local[next(iter(local))].device) for k, v in sd.items()}
        self.load_state_dict(shard_state_dict(self.config, list(local), sd, self.tp_size, self.tp_rank))

    def canonical_shapes(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the canonical state dict (no communication)."""
        h = self.config.hidden_size
        shapes = {"embed_tokens.weight": (self.vocab_size, h)}
        if self.embed_positions is not None:
            shapes["embed_positions.weight"] = tuple(self.embed_positions.shape)
        for i, layer in enumerate(self.layers):
            for part in ("input_norm", "post_attention_norm"):
                shapes.update({f"layers.{i}.{part}.{k}": tuple(v.shape)
                               for k, v in getattr(layer, part).state_dict().items()})
            shapes.update({f"layers.{i}.attention.{k}": v for k, v in layer.attention.canonical_shapes().items()})
            shapes.update({f"layers.{i}.mlp.{k}": v for k, v in layer.mlp.canonical_shapes().items()})
        shapes.update({f"final_norm.{k}": tuple(v.shape) for k, v in self.final_norm.state_dict().items()})
        if self.lm_head is not None:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes
