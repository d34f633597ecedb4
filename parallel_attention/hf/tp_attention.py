"""A transformers attention block made tensor parallel: one fused column-parallel QKV GEMM, this rank's heads
through transformers' own attention function (its masks, sliding windows, cache and dropout), a row-parallel
output projection. Shapes: `b` batch, `s` sequence, `h` hidden, `p` TP size, `nh`, `nkv` heads, `d` head dim.

    x [b, s, h]                       (replicated; transformers' modules are batch-first)
      | qkv: ColumnParallelLinear, forward identity, backward all-reduce dX
    mixed [b, s, (nh/p + 2 nkv_r) d]  rows [its q heads | its k heads | its v heads] (sharding.fuse_qkv)
      | views q [b, nh/p, s, d], k, v [b, nkv_r, s, d]; Qwen3: RMSNorm per head; OLMoE: over the whole
      |   projection (ProjectionRMSNorm: this rank's rows, the sum of squares all-reduced); rotary; cache.update
      | transformers' attention function on this rank's heads (on CPU without a mask: the chunked causal kernel)
    context [b, s, nh/p d]
      | o_proj: RowParallelLinear, forward all-reduce, backward identity
    y [b, s, h]

Gradients are complete when backward returns: k/v replicas (p > nkv) through `replica_grads`, the per-head q/k
norm weights (replicated, each rank's gradient covers its heads) through one copy-to-region on both.
"""

from __future__ import annotations

import torch
from torch import nn

from ..tensor_parallel.collectives import all_gather_along_dim
from ..tensor_parallel.mappings import copy_to_tensor_parallel_region
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.linear_functions import column_parallel_linear
from ..tensor_parallel.param_kinds import KvReplica, Replicated
from ..tensor_parallel.parallel_state import group_rank, group_size
from ..tensor_parallel.sharding import fuse_qkv, kv_heads_of_rank, row_shard, unfuse_qkv
from ..transformer.kernels import causal_chunks
from ..transformer.norms import HeadRMSNorm, ProjectionRMSNorm, normalize_projections
from . import transformers_api
from .replica_grads import complete_replica_grads
from .tp_mlp import device_dtype_of


class FusedQKVLinear(ColumnParallelLinear):
    """The fused projection [its q | its k | its v]; with k/v replicas (p > nkv) their gradient rows are summed
    over the replicas in the backward (`replica_grads`)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, group,
                 device=None, dtype: torch.dtype = torch.float32) -> None:
        p, rank = group_size(group), group_rank(group)
        self.kv_heads = kv_heads_of_rank(num_kv_heads, p, rank)
        rows = (num_heads // p + 2 * len(self.kv_heads)) * head_dim
        super().__init__(hidden, rows * p, bias=bias, init_std=None, tp_group=group, device=device, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        q_rows = num_heads // p * head_dim
        self.kv_rows = slice(q_rows, rows)
        self._complete = self._complete_replicas if p > num_kv_heads else _weights_as_they_are

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._complete(self.weight, self.bias)
        return self._exit(column_parallel_linear(x, weight, bias, self.comm))

    def _complete_replicas(self, weight, bias):
        tensors = (weight,) if bias is None else (weight, bias)
        done = complete_replica_grads(tensors, self.kv_rows, self.kv_heads[0], self.num_kv_heads, self.tp_group)
        return done[0], (done[1] if bias is not None else None)

    def load(self, q, k, v, attr: str) -> None:
        """Copy this rank's rows of full q, k, v weights (or biases) into `attr`."""
        with torch.no_grad():
            getattr(self, attr).copy_(fuse_qkv(q, k, v, self.num_heads, self.num_kv_heads, self.head_dim,
                                               self.tp_size, self.tp_rank))

    def full(self, attr: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full q, k, v of `attr` gathered from every rank (a collective)."""
        shards = all_gather_along_dim(getattr(self, attr).detach(), 0, self.tp_group).chunk(self.tp_size, 0)
        return unfuse_qkv(list(shards), self.num_heads, self.num_kv_heads, self.head_dim)

    def parameter_kinds(self) -> dict:
        kinds = super().parameter_kinds()
        if self.tp_size > self.num_kv_heads:
            replica = KvReplica(self.tp_group, rows=self.kv_rows, slot=self.kv_heads[0], num_slots=self.num_kv_heads,
                              sharded_dim=0, reduced_in_backward=True)
            kinds = {name: replica for name in kinds}
        return kinds


def _weights_as_they_are(weight, bias):
    """No k/v replicas to complete (p <= nkv): the weight and bias as they are."""
    return weight, bias


def _head_norm(source: nn.Module, group) -> HeadRMSNorm:
    """The library's per-head RMSNorm holding a copy of transformers' q_norm or k_norm."""
    weight = source.weight.detach()
    norm = HeadRMSNorm(weight.shape[0], source.variance_epsilon, False, group, weight.device, weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def _projection_norm(source: nn.Module, num_heads: int, head_dim: int, group) -> ProjectionRMSNorm:
    """The library's whole-projection RMSNorm holding this rank's heads' rows of transformers' (OLMoE's) norm."""
    weight = source.weight.detach()
    if weight.numel() != num_heads * head_dim:
        raise ValueError(f"parallelize: a q/k norm of width {weight.numel()} over {num_heads} heads of head_dim "
                         f"{head_dim}: the norm must span exactly the heads' projection (num_heads x head_dim).")
    norm = ProjectionRMSNorm(num_heads, head_dim, source.variance_epsilon, group, weight.device, weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(norm.shard_of(weight))
    return norm


class TensorParallelAttention(nn.Module):
    """transformers' attention of one decoder layer on this rank's heads (see the module docstring).

    `source` is the family's reading of the original module (`families`): full weights, rotary, norms, scaling.
    """

    def __init__(self, old: nn.Module, source, group) -> None:
        super().__init__()
        config = old.config
        self.config, self.layer_idx, self.is_causal = config, old.layer_idx, True
        self.scaling, self.head_dim = source.scaling(old), source.head_dim(old)
        self.attention_dropout = source.attention_dropout(old)
        self.sliding_window = source.sliding_window(old)
        num_heads, num_kv_heads, hidden = source.num_heads(config), source.num_kv_heads(config), config.hidden_size
        self.tp_group, p = group, group_size(group)
        q, k, v, o = source.weights(old)
        biases = source.biases(old)
        self.qkv = FusedQKVLinear(hidden, num_heads, num_kv_heads, self.head_dim, biases is not None, group,
                                  **device_dtype_of(q))
        self.qkv.load(q, k, v, "weight")
        if biases is not None:
            self.qkv.load(*biases, "bias")
        o_bias = source.o_bias(old)
        self.o_proj = RowParallelLinear(o.shape[1], hidden, bias=o_bias is not None, input_is_parallel=True,
                                        init_std=None, tp_group=group, **device_dtype_of(o))
        with torch.no_grad():
            self.o_proj.weight.copy_(row_shard(o, p, group_rank(group)))
            if o_bias is not None:
                self.o_proj.bias.copy_(o_bias)
        heads, kv = num_heads // p, len(self.qkv.kv_heads)
        self.num_key_value_groups = heads // kv
        self._split = [heads * self.head_dim, kv * self.head_dim, kv * self.head_dim]
        self._init_norms(old, source)
        rotary, self._eager = transformers_api.family_functions(old)  # transformers' modeling file of this family
        self._rotary = rotary if source.rotary else None
        self._position = self._rotate if source.rotary else _no_positions
        self.resid_dropout = getattr(old, "resid_dropout", nn.Identity())
        self._names = source
        self._choose()

    def _choose(self) -> None:
        """The project's CPU chunked causal kernel (causal_chunks) where it computes what transformers' SDPA would:
        on CPU, SDPA configured, no attention dropout, no sliding window, the default 1/sqrt(d) scale; per call it
        still needs no mask (no padding) and self-attention of 128..512 tokens (`causal_chunks.applies`)."""
        chunkable = (self.qkv.weight.device.type == "cpu" and transformers_api.attn_implementation(self.config) == "sdpa"
                     and self.attention_dropout == 0.0 and self.sliding_window is None
                     and self.scaling == self.head_dim ** -0.5 and causal_chunks.kernel_available())
        self._attend = self._chunked_or_transformers if chunkable else self._transformers_attention

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        self._choose()
        return out

    def _init_norms(self, old: nn.Module, source) -> None:
        """Per-head norms (Qwen3), whole-projection norms (OLMoE: one all-reduce forward, one backward) or none."""
        norms, projections = source.head_norms(old), source.projection_norms(old)
        self._head_norms = _no_norms
        if norms is not None:
            self.q_norm, self.k_norm = (_head_norm(n, self.tp_group) for n in norms)
            self._head_norms = self._normalize_heads
        elif projections is not None:
            counts = source.num_heads(old.config), source.num_kv_heads(old.config)
            self.q_norm, self.k_norm = (_projection_norm(n, count, self.head_dim, self.tp_group)
                                        for n, count in zip(projections, counts))
            replicas = group_size(self.tp_group) > counts[1]  # k/v heads replicated: so are the k norm's rows
            self._head_norms = self._normalize_projections_k_replicas if replicas else self._normalize_projections

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None,
                past_key_values=None, **kwargs):
        batch_seq = hidden_states.shape[:-1]
        q, k, v = self.qkv(hidden_states).split(self._split, dim=-1)
        q, k = self._head_norms(q.view(*batch_seq, -1, self.head_dim), k.view(*batch_seq, -1, self.head_dim))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(*batch_seq, -1, self.head_dim).transpose(1, 2)
        q, k = self._position(q, k, position_embeddings)
        cache = cache if cache is not None else past_key_values
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        kwargs.pop("output_attentions", None)
        out, weights = self._attend(q, k, v, attention_mask, **kwargs)
        return self.resid_dropout(self.o_proj(out.reshape(*batch_seq, -1))), weights

    def _transformers_attention(self, q, k, v, attention_mask, **kwargs):
        attend = transformers_api.attention_function(self.config, self._eager)
        return attend(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                      scaling=self.scaling, sliding_window=self.sliding_window, **kwargs)

    def _chunked_or_transformers(self, q, k, v, attention_mask, **kwargs):
        if attention_mask is None and causal_chunks.applies(q, k, v, 0.0):  # [b, nh, s, d] laid out [b, s, nh, d]
            return causal_chunks.chunked_causal_attention(q, k, v).transpose(1, 2), None
        return self._transformers_attention(q, k, v, attention_mask, **kwargs)

    def parameter_kinds(self) -> dict:
        """The q/k norm weights are complete after backward: `_normalize_heads` passes them through one
        copy-to-region, whose backward all-reduces them (transformers' loops never call finalize_grads)."""
        if self._head_norms == self._normalize_heads:
            return {f"{norm}.weight": Replicated(self.tp_group) for norm in ("q_norm", "k_norm")}
        if self._head_norms == self._normalize_projections_k_replicas:  # summed in backward, as the QKV's rows
            return {"k_norm.weight": KvReplica(self.tp_group, rows=slice(None), slot=self.qkv.kv_heads[0],
                                               num_slots=self.qkv.num_kv_heads, reduced_in_backward=True)}
        return {}  # none, or ProjectionRMSNorm's own (Sharded) declaration

    def _normalize_heads(self, q: torch.Tensor, k: torch.Tensor):
        both = copy_to_tensor_parallel_region(torch.cat([self.q_norm.weight, self.k_norm.weight]), self.tp_group)
        wq, wk = both.split(self.head_dim)
        return self.q_norm.normalize(q, wq), self.k_norm.normalize(k, wk)

    def _normalize_projections(self, q: torch.Tensor, k: torch.Tensor):
        return normalize_projections(q, k, self.q_norm, self.k_norm)

    def _normalize_projections_k_replicas(self, q: torch.Tensor, k: torch.Tensor):
        """p > nkv: the ranks sharing this rank's k/v head hold the same rows of the k norm, each a share of their
        gradient: summed over them in the backward (`replica_grads`, one all-reduce)."""
        (k_weight,) = complete_replica_grads((self.k_norm.weight,), slice(None), self.qkv.kv_heads[0],
                                             self.qkv.num_kv_heads, self.tp_group)
        return normalize_projections(q, k, self.q_norm, self.k_norm, weights=(self.q_norm.weight, k_weight))

    def _rotate(self, q, k, position_embeddings):
        cos, sin = position_embeddings
        return self._rotary(q, k, cos, sin)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights under the family's transformers names (a collective)."""
        full = {"weight": self.qkv.full("weight"), "bias": self.qkv.full("bias") if self.qkv.bias is not None
                else None}
        o_weight = all_gather_along_dim(self.o_proj.weight.detach(), 1, self.tp_group)
        o_bias = self.o_proj.bias.detach().clone() if self.o_proj.bias is not None else None
        out = self._names.state_dict(full, o_weight, o_bias)
        if self._head_norms is not _no_norms:
            out.update({"q_norm.weight": self.q_norm.gathered(), "k_norm.weight": self.k_norm.gathered()})
        return out


def _no_norms(q, k):
    return q, k


def _no_positions(q, k, position_embeddings):
    return q, k
