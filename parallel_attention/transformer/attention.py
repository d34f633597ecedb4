"""ParallelSelfAttention: Megatron-style tensor-parallel self-attention.

Shape legend: s sequence, b batch, h hidden, p tensor-parallel size, nh heads, nkv k/v heads
(query groups), d head dim; nhl = nh/p and nkvl = max(nkv/p, 1) heads on this rank.

    x [s, b, h]                       (sequence_parallel: [s/p, b, h], chunks in rank order)
      | query_key_value: ColumnParallelLinear h -> (nh + 2 nkv) d, each rank the rows of its heads
      |   fwd identity / bwd all-reduce  (SP: fwd all-gather s / bwd reduce-scatter s)
    mixed [s, b, (nhl + 2 nkvl) * d]  [this rank's q heads | its k heads | its v heads]
      | split: q, k, v are views of mixed (no copy); q/k norm, rotary on q, k (each optional; the q/k norm over
      |   the whole projection sums its squares over the ranks: 1 all-reduce fwd, 1 bwd, norms.py)
    q [b, nhl, s, d], k, v [b, nkvl, s, d]
      | local attention (SDPA / the CPU chunked kernel / math / apex), dropout from the tensor-parallel generator
      |   (dropout_rng='layout_invariant': explicit probabilities, masks hashed from global coordinates)
      |   CP (cp > 1; x is this rank's zigzag part, [s/cp, b, h], SP [s/(cp p), b, h]): the ring or the all-to-all
      |   around it (context_parallel/), rotary at the part's global positions
    context [s, b, nhl * d]
      | dense: RowParallelLinear nh d -> h, input_is_parallel
      |   fwd all-reduce / bwd identity  (SP: fwd reduce-scatter s / bwd all-gather s)
    y [s, b, h]                       (sequence_parallel: [s/p, b, h])

Rank r owns query heads r*nhl .. (r+1)*nhl - 1. When p > nkv, p/nkv consecutive ranks share
k/v head r // (p/nkv), each holding a replica; finalize_grads() sums the replicas' gradients.

Memory: the kernel saves q, k, v for backward. As views they keep exactly `mixed` alive, which holds
nothing else. With rotary, q and k are new tensors, so v is copied (nkvl d columns) rather than keep all
of `mixed` alive for it. Checkpoint format 1 held the rows per group ([q heads | k | v] per k/v head):
under GQA q then needed a copy and k, v views kept the copied rows alive too (measured in 0.1).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..tensor_parallel import sharding
from .attention_config import AttentionConfig
from .kernels.core_attention import build_core_attention
from ..tensor_parallel.param_kinds import KvReplica
from .kv_cache import LayerKVCache
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, unchanged
from ..tensor_parallel.collectives import all_gather_along_dim
from ..tensor_parallel.linear_functions import OVERLAP_COMM
from ..tensor_parallel.parallel_state import ProcessGroup, group_rank, group_size, resolve_cp_group, resolve_tp_group
from .context_parallel import ContextParallelPart, build_context_parallel_core
from .rotary import build_position_embedding
from .documents import DocumentLayout
from .norms import build_qk_norms


def _own_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of t, not a view of the buffer it lies in."""
    return t.contiguous()


def _check_documents(documents: DocumentLayout | None, b: int, s: int) -> None:
    if documents is not None and documents.shape != (b, s):
        raise ValueError(f"documents describe [b, s] = {list(documents.shape)} but the attention sees [{b}, {s}]: "
                         "build the DocumentLayout from the full sequence's document_ids (also under SP).")


def _check_mask(m: torch.Tensor, b: int, s: int) -> None:
    if m.dtype != torch.bool:
        raise ValueError(f"attention_mask must be boolean (True = may attend), got dtype {m.dtype}.")
    if m.dim() != 4 or m.shape[0] not in (1, b) or m.shape[1] != 1 or m.shape[2] not in (1, s) or m.shape[3] != s:
        raise ValueError(f"attention_mask of shape {tuple(m.shape)} is not broadcastable to [b, 1, s, s] = "
                         f"[{b}, 1, {s}, {s}]: pass [b, 1, 1, s] key padding or a [b, 1, s, s] pattern.")


class ParallelSelfAttention(nn.Module):
    def __init__(self, config: AttentionConfig, tp_group: ProcessGroup | DeviceMesh | None = None, device=None,
                 layer_number: int = 0, recompute_core: bool = False, *, sequence_parallel: bool = False,
                 overlap_comm: bool = OVERLAP_COMM, cp_group: ProcessGroup | DeviceMesh | None = None,
                 context_parallel_kind: str = "all_to_all") -> None:
        """The block `config` describes, over `tp_group` (a ProcessGroup or a 1-D DeviceMesh such as mesh["tp"];
        None: the default group of initialize_model_parallel) and `cp_group` (likewise; at cp > 1 the input is
        this rank's zigzag part of the sequence, and `context_parallel_kind` is "ring" or "all_to_all").

        sequence_parallel: the input and output are this rank's [s/p, b, h] chunk of the sequence (default False).
        overlap_comm: the projections' backward collectives overlap their GEMMs (default True).
        recompute_core: recompute softmax(q k^T) v in backward instead of keeping what the kernel saves
        (selective recomputation; q, k, v and the projections' outputs are kept)."""
        super().__init__()
        self.config = config
        self.sequence_parallel = sequence_parallel
        self.tp_group = resolve_tp_group(tp_group)
        self.tp_size, self.tp_rank = group_size(self.tp_group), group_rank(self.tp_group)
        self.num_heads_per_rank, self.num_kv_heads_per_rank = config.per_rank_heads(self.tp_size)
        self.queries_per_group = self.num_heads_per_rank // self.num_kv_heads_per_rank
        self.kv_replicated = self.tp_size > config.num_kv_heads
        d, h = config.head_dim, config.hidden_size
        qkv_per_rank = (self.num_heads_per_rank + 2 * self.num_kv_heads_per_rank) * d
        common = dict(sequence_parallel=sequence_parallel, init_std=None, tp_group=self.tp_group,
                      device=device, dtype=config.params_dtype)
        self.query_key_value = ColumnParallelLinear(h, qkv_per_rank * self.tp_size, bias=config.qkv_bias,
                                                    overlap_comm=overlap_comm, **common)
        self.dense = RowParallelLinear(config.num_heads * d, h, bias=config.out_bias, input_is_parallel=True,
                                       **common)
        # under sequence parallelism the input is this rank's [s/p, b, h] chunk of the sequence
        self._sequence_chunks = self.tp_size if sequence_parallel else 1
        self._input_hint = " (sequence parallel: this rank's [s/p, b, h] chunk)" if sequence_parallel else ""
        # layer_number and this rank's first global head name its dropout masks (dropout_rng='layout_invariant')
        self.core_attention = build_core_attention(config, self.tp_rank * self.num_heads_per_rank, layer_number,
                                                   recompute_core, device)
        self.cp_group = resolve_cp_group(cp_group)
        self.context = ContextParallelPart(self.cp_group)  # this rank's part of the sequence (cp = 1: all of it)
        if self.context.cp > 1:
            self.core_attention = build_context_parallel_core(
                context_parallel_kind, config, self.cp_group, self.tp_rank * self.num_heads_per_rank,
                (self.num_heads_per_rank, self.num_kv_heads_per_rank), layer_number, recompute_core, device)
        self.position_embedding = build_position_embedding(config)
        # qk_norm: RMSNorm over each head's q and k or over the whole projections, before rotary (else the identity)
        self.q_norm, self.k_norm, self._normalize_qk = build_qk_norms(config, self.tp_group, device)
        # rotary makes q, k new tensors: a copy of v then frees mixed after the forward
        self._own_values = _own_copy if config.rotary else unchanged
        self.load_canonical_state_dict(self._initial_canonical_weights(device))

    # ----------------------------------------------------------------------------- weights
    def canonical_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        shapes = {"q_proj.weight": (c.num_heads * c.head_dim, c.hidden_size),
                  "k_proj.weight": (c.num_kv_heads * c.head_dim, c.hidden_size),
                  "v_proj.weight": (c.num_kv_heads * c.head_dim, c.hidden_size),
                  "o_proj.weight": (c.hidden_size, c.num_heads * c.head_dim)}
        if c.qkv_bias:
            shapes.update({f"{n}.bias": shapes[f"{n}.weight"][:1] for n in ("q_proj", "k_proj", "v_proj")})
        if c.out_bias:
            shapes["o_proj.bias"] = (c.hidden_size,)
        if c.qk_norm:
            shapes.update({f"{n}_norm.weight": (width,) for n, width in zip("qk", c.qk_norm_widths())})
        return shapes

    def _initial_canonical_weights(self, device) -> dict[str, torch.Tensor]:
        """Full weights drawn from the default generator in a fixed order: independent of p."""
        weights = {}
        for name, shape in self.canonical_shapes().items():
            t = torch.empty(shape, device=device, dtype=self.config.params_dtype)
            if name.endswith("norm.weight"):  # q_norm, k_norm: ones, drawing nothing
                weights[name] = t.fill_(1.0)
            else:
                weights[name] = t.normal_(0.0, self.config.init_std) if name.endswith("weight") else t.zero_()
        return weights

    def _fuse_local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = self.config
        return sharding.fuse_qkv(q, k, v, c.num_heads, c.num_kv_heads, c.head_dim, self.tp_size, self.tp_rank)

    def _unfuse_all(self, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full q, k, v gathered from every rank's fused rows (a collective)."""
        gathered = all_gather_along_dim(local, 0, self.tp_group).chunk(self.tp_size, dim=0)
        c = self.config
        return sharding.unfuse_qkv(list(gathered), c.num_heads, c.num_kv_heads, c.head_dim)

    @torch.no_grad()
    def load_canonical_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full, p-independent weights (q_proj/k_proj/v_proj/o_proj .weight/.bias); keep my shard."""
        c = self.config
        sharding.check_canonical(state_dict, self.canonical_shapes(), "canonical state dict",
                                 f" (hidden_size={c.hidden_size}, num_heads={c.num_heads}, num_kv_heads="
                                 f"{c.num_kv_heads}, head_dim={c.head_dim}, qkv_bias={c.qkv_bias}, out_bias={c.out_bias}, "
                                 f"qk_norm={c.qk_norm}, qk_norm_scope={c.qk_norm_scope!r})")
        sd = {k: v.to(device=self.dense.weight.device, dtype=self.dense.weight.dtype) for k, v in state_dict.items()}
        qkv = self.query_key_value
        qkv.weight.copy_(self._fuse_local(sd["q_proj.weight"], sd["k_proj.weight"], sd["v_proj.weight"]))
        if qkv.bias is not None:
            qkv.bias.copy_(self._fuse_local(sd["q_proj.bias"], sd["k_proj.bias"], sd["v_proj.bias"]))
        self.dense.weight.copy_(sharding.row_shard(sd["o_proj.weight"], self.tp_size, self.tp_rank))
        if self.dense.bias is not None:
            self.dense.bias.copy_(sd["o_proj.bias"])
        for name in self._head_norm_names():
            norm = getattr(self, name)
            norm.weight.copy_(norm.shard_of(sd[f"{name}.weight"]))

    def _head_norm_names(self) -> tuple[str, ...]:
        return ("q_norm", "k_norm") if self.config.qk_norm else ()

    @torch.no_grad()
    def canonical_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, p-independent weights on every rank. A collective: every rank of the group calls it."""
        qkv = self.query_key_value
        out = dict(zip(("q_proj.weight", "k_proj.weight", "v_proj.weight"),
                       self._unfuse_all(qkv.weight)))
        if qkv.bias is not None:
            out.update(zip(("q_proj.bias", "k_proj.bias", "v_proj.bias"),
                           self._unfuse_all(qkv.bias)))
        out["o_proj.weight"] = all_gather_along_dim(self.dense.weight, 1, self.tp_group)
        if self.dense.bias is not None:
            out["o_proj.bias"] = self.dense.bias.detach().clone()
        out.update({f"{name}.weight": getattr(self, name).gathered() for name in self._head_norm_names()})
        return out

    def parameter_kinds(self) -> dict:
        """Replicated k/v heads (p > nkv): each replica's rows of the fused QKV weight/bias are KvReplica
        (its gradient covers only this rank's queries); the other rows stay sharded."""
        if not self.kv_replicated or self.tp_size == 1:
            return {}
        d, qpg = self.config.head_dim, self.queries_per_group
        kind = KvReplica(self.tp_group, rows=slice(qpg * d, (qpg + 2) * d),  # one local group: [q heads | k | v]
                       slot=sharding.kv_heads_of_rank(self.config.num_kv_heads, self.tp_size, self.tp_rank)[0],
                       num_slots=self.config.num_kv_heads, sharded_dim=0)
        return {f"query_key_value.{name}": kind for name, _ in self.query_key_value.named_parameters()}

    # ----------------------------------------------------------------------------- forward
    def _check_inputs(self, x, attention_mask, position_ids) -> int:
        """Validate shapes; return this rank's sequence length s (under SP the gathered one; under CP its part)."""
        h = self.config.hidden_size
        if x.dim() != 3 or x.shape[-1] != h:
            raise ValueError(f"hidden_states must be [s, b, h] with h={h}, got shape {tuple(x.shape)}"
                             f"{self._input_hint}")
        s = x.shape[0] * self._sequence_chunks
        b = x.shape[1]
        if attention_mask is not None:
            _check_mask(attention_mask, b, self.context.full_length(s))  # over the full sequence, also under CP
        if position_ids is not None:
            if position_ids.dtype.is_floating_point or position_ids.shape not in ((s,), (b, s)):
                raise ValueError(
                    f"position_ids must be integer [s] or [b, s] = [{s}] or [{b}, {s}], "
                    f"got shape {tuple(position_ids.shape)} and dtype {position_ids.dtype}."
                )
        return s

    def _project(self, x: torch.Tensor, s: int, position_ids, offset: int):
        """Fused QKV projection, split per local group, positions applied: q, k, v as [b, heads, s, d]."""
        d, nhl, nkvl = self.config.head_dim, self.num_heads_per_rank, self.num_kv_heads_per_rank
        mixed = self.query_key_value(x)  # [s, b, (nhl + 2 nkvl) d]
        b = mixed.shape[1]
        # split, not three slices: its backward is one concatenation instead of three zero-filled
        # buffers of the fused size added together (measured: ~3% of a CPU step)
        q, k, v = (t.view(s, b, -1, d) for t in mixed.split([nhl * d, nkvl * d, nkvl * d], dim=-1))
        q, k = self.position_embedding(*self._normalize_qk(q, k, self.q_norm, self.k_norm), position_ids, offset)
        return tuple(t.permute(1, 2, 0, 3) for t in (q, k, self._own_values(v)))

    def _output(self, context: torch.Tensor) -> torch.Tensor:
        """context [b, nhl, s, d] -> dense (row-parallel) -> [s, b, h] (SP: [s/p, b, h])."""
        b, _, s, d = context.shape
        return self.dense(context.permute(2, 0, 1, 3).reshape(s, b, self.num_heads_per_rank * d))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, documents: DocumentLayout | None = None) -> torch.Tensor:
        """[s, b, h] -> [s, b, h] (sequence parallel: this rank's [s/p, b, h] chunks).

        documents: the batch's packed documents (DocumentLayout.from_ids, built once per batch, of the full
        [b, s] sequence also under SP): attention never crosses a document, and unless `position_ids` are given
        the rotary positions restart at 0 in each document."""
        s = self._check_inputs(hidden_states, attention_mask, position_ids)
        _check_documents(documents, hidden_states.shape[1], self.context.full_length(s))
        self.context.check(s)
        positions = self.context.positions(documents, position_ids, s, hidden_states.device)
        q, k, v = self._project(hidden_states, s, positions, offset=0)
        return self._output(self.core_attention(q, k, v, attention_mask, self.config.causal, documents))

    def decode(self, hidden_states: torch.Tensor, cache: LayerKVCache) -> torch.Tensor:
        """Incremental decoding: hidden_states [n, b, h] are the n new tokens after those in `cache`.

        Keys and values of the new tokens are appended to the cache; the new queries attend every
        cached key, causally by position. Needs sequence_parallel=False and no padding mask.
        """
        if self.sequence_parallel or self.context.cp > 1:
            raise ValueError("decode() needs sequence_parallel=False and context_parallel_size=1: build the decoding "
                             "model without them.")
        s = self._check_inputs(hidden_states, None, None)
        q, k, v = self._project(hidden_states, s, None, offset=cache.offset)
        k, v = cache.update(k, v)
        mask = cache.causal_mask(s, q.device) if self.config.causal else None
        return self._output(self.core_attention(q, k, v, mask, False))

    def extra_repr(self) -> str:
        return (f"tp_size={self.tp_size}, sequence_parallel={self.sequence_parallel}, "
                f"num_heads_per_rank={self.num_heads_per_rank}, num_kv_heads_per_rank={self.num_kv_heads_per_rank}, "
                f"kv_replicated={self.kv_replicated}")
