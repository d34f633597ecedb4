"""GPT model on the tensor-parallel layers: embedding, pre-norm transformer layers, vocab-parallel loss.

    tokens [b, s] -> transpose -> [s, b]
      | VocabParallelEmbedding (+ learned positions)       -> [s, b, h]  (SP: [s/p, b, h])
      | TransformerLayer x L: x + drop(attn(norm(x))); x + drop(mlp(norm(x)))
      | final norm
      | output layer (tied to the embedding, or its own ColumnParallelLinear) -> logits [s, b, V/p]
      | vocab_parallel_cross_entropy: the full logits are never gathered
    loss (mean over tokens)

Dropout (`dropout.py`): by default, activations replicated across the tensor-parallel group draw from the default
generator (identical on every rank) and sequence-parallel chunks from the tensor-parallel generator; with
model.dropout_rng='layout_invariant' every mask is hashed from its global coordinates, the layer index among them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..tensor_parallel import collectives, expert_shards, mappings, sharding
from ..tensor_parallel.layers import OutputLinear, TiedOutputLayer, VocabParallelEmbedding
from ..tensor_parallel.linear_functions import OVERLAP_COMM
from ..tensor_parallel.param_kinds import PartialGrad, Replicated, Sharded, parameter_kinds
from ..tensor_parallel.parallel_state import ProcessGroup, group_rank, group_size, resolve_cp_group, resolve_tp_group
from ..tensor_parallel.rng import checkpoint_with_tp_rng
from .attention import ParallelSelfAttention
from .context_parallel import ContextParallelPart
from .cross_entropy import IGNORE_INDEX, check_ids, vocab_parallel_cross_entropy_
from .documents import DocumentLayout
from .dropout import DropoutSite, build_hidden_dropout
from .kv_cache import KVCache
from .moe import build_mlp, counted_tokens_of, replaying
from .model_config import ModelConfig
from .model_layout import shard_state_dict, unshard
from .norms import build_norm
from .pipeline_stage import PartSeeds, PipelineStage, StageLayers


class TransformerLayer(nn.Module):
    """Pre-norm block: x + dropout(attention(norm(x))), then x + dropout(mlp(norm(x)))."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, tp_group: ProcessGroup | None, device, dtype,
                 layer_number: int = 0, overlap_comm: bool = OVERLAP_COMM, **context_parallel):
        """context_parallel: cp_group=, context_parallel_kind= of ParallelSelfAttention."""
        super().__init__()
        norm = lambda: build_norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, sequence_parallel,  # noqa: E731
                                  tp_group, device, dtype)
        self.input_norm = norm()
        self.attention = ParallelSelfAttention(cfg.attention_config(dtype), tp_group, device, layer_number,
                                               _recomputes_core(cfg), sequence_parallel=sequence_parallel,
                                               overlap_comm=overlap_comm, **context_parallel)
        self.post_attention_norm = norm()
        cp_group = resolve_cp_group(context_parallel.get("cp_group"))  # hidden dropout hashes global positions
        self.mlp = build_mlp(cfg, layer_number, sequence_parallel, resolve_tp_group(tp_group), cp_group, device, dtype,
                             overlap_comm)  # dense, or a mixture of experts (model.num_experts)
        dropout = lambda site: build_hidden_dropout(cfg.hidden_dropout, cfg.dropout_rng,  # noqa: E731
                                                    sequence_parallel, tp_group, layer_number, site, cp_group)
        self.attention_output_dropout = dropout(DropoutSite.ATTENTION_OUTPUT)
        self.mlp_output_dropout = dropout(DropoutSite.MLP_OUTPUT)

    def forward(self, x: torch.Tensor, documents: DocumentLayout | None = None) -> torch.Tensor:
        x = x + self.attention_output_dropout(self.attention(self.input_norm(x), documents=documents))
        return x + self.mlp_output_dropout(self.mlp(self.post_attention_norm(x)))

    def decode(self, x: torch.Tensor, cache) -> torch.Tensor:
        """forward() for new tokens only, attending the cached keys and values (see ParallelSelfAttention.decode)."""
        x = x + self.attention_output_dropout(self.attention.decode(self.input_norm(x), cache))
        return x + self.mlp_output_dropout(self.mlp(self.post_attention_norm(x)))


def _recomputes_core(cfg: ModelConfig) -> bool:
    """Selective recomputation: only the attention core is recomputed (model.recompute_granularity)."""
    if cfg.recompute_granularity not in ("full", "selective"):
        raise ValueError(f"recompute_granularity={cfg.recompute_granularity!r} is unknown; choose full or selective.")
    return cfg.recompute_activations and cfg.recompute_granularity == "selective"


def _run_layer(layer: nn.Module, x: torch.Tensor, documents: DocumentLayout | None) -> torch.Tensor:
    return layer(x, documents)


def _run_layer_recomputed(layer: nn.Module, x: torch.Tensor, documents: DocumentLayout | None) -> torch.Tensor:
    """Keep only the layer's input; recompute its activations in backward (TP dropout replayed)."""
    if not (layer.training and torch.is_grad_enabled()):
        return layer(x, documents)
    return checkpoint_with_tp_rng(replaying(layer), x, documents)  # MoE: in the counted tokens of its forward


class GPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig, sequence_parallel: bool = False, tp_group: ProcessGroup | None = None,
                 device=None, dtype: torch.dtype = torch.float32, overlap_comm: bool = OVERLAP_COMM, *,
                 cp_group: ProcessGroup | None = None, context_parallel_kind: str = "all_to_all",
                 stage: PipelineStage = PipelineStage()) -> None:
        """tp_group, cp_group: a ProcessGroup or a 1-D DeviceMesh (None: the default group). sequence_parallel,
        overlap_comm: the layout of the parallel linears (parallel.* of a run config). At cp > 1 forward takes
        the full [b, s] on every rank of the cp group and keeps its zigzag part (context_parallel_kind: "ring" or
        "all_to_all"). stage: the part of the model this module holds (a pipeline stage; default the whole)."""
        super().__init__()
        self.context = ContextParallelPart(resolve_cp_group(cp_group))
        self.config, self.sequence_parallel, self.stage = cfg, sequence_parallel, stage
        self.tp_group = resolve_tp_group(tp_group)
        self.tp_size, self.tp_rank = group_size(self.tp_group), group_rank(self.tp_group)
        self.vocab_size = cfg.vocab_size
        self.padded_vocab_size = sharding.padded_vocab_size(cfg.vocab_size, self.tp_size)
        h, std, seeds = cfg.hidden_size, cfg.init_std, PartSeeds(device)  # the same weights at any p, pp, split
        self.embed_tokens = self.embed_positions = None  # the last stage holds a copy of a tied table
        if stage.has_embedding or (stage.has_head and cfg.tie_embeddings):
            self.embed_tokens = VocabParallelEmbedding(self.padded_vocab_size, h, init_std=None,
                                                       sequence_parallel=sequence_parallel, tp_group=self.tp_group,
                                                       device=device, dtype=dtype)
            with seeds.seeded(PartSeeds.TOKEN_TABLE):
                self._load_vocab_rows(self.embed_tokens.weight, self._normal((cfg.vocab_size, h), std, device, dtype))
        if cfg.position_embedding == "learned" and stage.has_embedding:
            with seeds.seeded(PartSeeds.POSITIONS):
                self.embed_positions = nn.Parameter(self._normal((cfg.max_seq_len, h), std, device, dtype))
        self.embedding_dropout = build_hidden_dropout(cfg.hidden_dropout, cfg.dropout_rng, sequence_parallel,
                                                      self.tp_group, 0, DropoutSite.EMBEDDING, self.context.group)
        layers, ranges = {}, stage.layer_ranges(cfg.num_layers)
        for i in (i for r in ranges for i in r):
            with seeds.seeded(PartSeeds.FIRST_LAYER + i):
                layers[i] = TransformerLayer(cfg, sequence_parallel, self.tp_group, device, dtype, i,
                                             overlap_comm=overlap_comm, cp_group=self.context.group,
                                             context_parallel_kind=context_parallel_kind)
        self.layers = StageLayers(layers)
        self._build_head(cfg, overlap_comm, device, dtype, seeds)
        # per model chunk, chosen once: where its input comes from, its layers, where its output goes
        last = len(ranges) - 1
        self._enters = [self._embed_tokens if c == 0 and stage.has_embedding else self._take_hidden
                        for c in range(len(ranges))]
        self._chunk_layers = [[layers[i] for i in r] for r in ranges]
        self._exits = [self._loss_or_logits if c == last and stage.has_head else self._hidden_out
                       for c in range(len(ranges))]
        self._positions = self._my_positions if sequence_parallel else self._all_positions
        self._counted_tokens = counted_tokens_of(cfg, self.context.keep_part, self._positions)  # MoE's (labels)
        full = cfg.recompute_activations and cfg.recompute_granularity == "full"  # selective: TransformerLayer
        self._run_layer = _run_layer_recomputed if full else _run_layer

    def _build_head(self, cfg: ModelConfig, overlap_comm: bool, device, dtype, seeds: PartSeeds) -> None:
        """The final norm and the output layer (tied: reading the embedding table, or the last stage's copy)."""
        self.final_norm = self.lm_head = None
        if not self.stage.has_head:
            return
        h = cfg.hidden_size
        self.final_norm = build_norm(cfg.norm, h, cfg.norm_eps, self.sequence_parallel, self.tp_group, device, dtype)
        if cfg.tie_embeddings:
            self.lm_head = TiedOutputLayer(self.embed_tokens, self.sequence_parallel, overlap_comm)
            return
        self.lm_head = OutputLinear(h, self.padded_vocab_size, bias=False, init_std=None,
                                    sequence_parallel=self.sequence_parallel, tp_group=self.tp_group,
                                    device=device, dtype=dtype, overlap_comm=overlap_comm)
        with seeds.seeded(PartSeeds.OUTPUT_LAYER):
            self._load_vocab_rows(self.lm_head.weight, self._normal((cfg.vocab_size, h), cfg.init_std, device, dtype))

    def pipeline_copies(self) -> list[nn.Parameter]:
        """This stage's copies of another stage's parameters (tied embeddings), which the norm counts there."""
        tied_copy = self.stage.has_head and not self.stage.has_embedding and self.config.tie_embeddings
        return [self.embed_tokens.weight] if tied_copy else []

    @staticmethod
    def _normal(shape, std, device, dtype) -> torch.Tensor:
        return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std)
    @torch.no_grad()
    def _load_vocab_rows(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """Copy this rank's rows of a full [V, h] table, padding rows past V with zeros."""
        shard.copy_(sharding.vocab_shard(full, self.padded_vocab_size, self.tp_size, self.tp_rank))

    def parameter_kinds(self) -> dict:
        """Learned positions are replicated; under SP each rank adds only its own positions' gradient."""
        if self.embed_positions is None:
            return {}
        return {"embed_positions": PartialGrad(self.tp_group) if self.sequence_parallel else Replicated(self.tp_group)}

    def _all_positions(self, table: torch.Tensor) -> torch.Tensor:
        return table

    def _my_positions(self, table: torch.Tensor) -> torch.Tensor:
        return table.chunk(self.tp_size, dim=0)[self.tp_rank]

    def _embed(self, tokens: torch.Tensor, offset: int, documents: DocumentLayout | None = None) -> torch.Tensor:
        s = tokens.shape[1]  # under CP this rank's part
        if self.context.full_length(s) + offset > self.config.max_seq_len:
            raise ValueError(f"sequence of {self.context.full_length(s) + offset} tokens exceeds "
                             f"model.max_seq_len={self.config.max_seq_len}.")
        check_ids(tokens, self.vocab_size, "token")
        x = self.embed_tokens(tokens.t())  # [s, b, h]; SP: [s/p, b, h]
        if self.embed_positions is not None:  # with documents, positions restart in each
            x = x + self._positions(self.context.position_table(self.embed_positions, documents, offset, s))
        return self.embedding_dropout(x)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                ignore_index: int = IGNORE_INDEX, document_ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
        """tokens [b, s] -> mean loss over the labels [b, s] that are not `ignore_index`, or local logits
        [s, b, V_padded/p] without labels (MoE layers leave ignored labels' tokens out of their auxiliary losses).

        document_ids [b, s]: packed documents (tokens of a row with equal ids form one, contiguous): attention
        never crosses a document and positions restart at 0 in each; the layout is built here once per batch
        and shared by every layer. The labels stay the caller's: ignore those that predict the next document's
        first token (documents.mask_cross_document_labels) for the loss of each document alone.

        Pipeline stage: one model `chunk` at a time (each given the labels, for MoE); a chunk after another
        stage's takes its output as `hidden` [s, b, h] (SP: [s/p, b, h]), and one before another's returns its own."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [b, s], got shape {tuple(tokens.shape)}.")
        documents = None if document_ids is None else DocumentLayout.from_ids(document_ids, tuple(tokens.shape))
        x = self._enters[chunk](tokens, documents, hidden)
        with self._counted_tokens(labels, ignore_index):  # MoE: the tokens its auxiliary losses count
            for layer in self._chunk_layers[chunk]:
                x = self._run_layer(layer, x, documents)
        return self._exits[chunk](x, labels, ignore_index)

    def _embed_tokens(self, tokens: torch.Tensor, documents: DocumentLayout | None, hidden) -> torch.Tensor:
        return self._embed(self.context.keep_part(tokens, 1), 0, documents)

    def _take_hidden(self, tokens: torch.Tensor, documents: DocumentLayout | None, hidden) -> torch.Tensor:
        if hidden is None:
            raise ValueError(f"this chunk ({self.stage.describe()}) starts from the previous stage's: pass hidden=.")
        return hidden

    def _hidden_out(self, x: torch.Tensor, labels, ignore_index: int) -> torch.Tensor:
        return x  # the next stage's input

    def _loss_or_logits(self, x: torch.Tensor, labels: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
        logits = self.lm_head(self.final_norm(x))  # with labels the loss overwrites them (softmax, no second buffer)
        if labels is None:
            return logits
        labels = self.context.keep_part(labels, 1)
        losses = vocab_parallel_cross_entropy_(logits, labels.t(), self.vocab_size, self.tp_group, ignore_index)
        return self.context.mean_loss(losses.sum(), (labels != ignore_index).sum())  # == mean() if nothing ignored

    def new_kv_cache(self, batch_size: int, max_len: int) -> KVCache:
        attn = self.layers[0].attention
        return KVCache(len(self.layers), batch_size, attn.num_kv_heads_per_rank, attn.config.head_dim, max_len,
                       device=self.final_norm.weight.device, dtype=self.final_norm.weight.dtype)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Full-vocabulary logits [b, V] of the last of `tokens` [b, n], the n tokens after those in `cache`."""
        if self.sequence_parallel or self.context.cp > 1:
            raise ValueError("decoding needs a GPTModel built with sequence_parallel=False and context parallel "
                             f"size 1 (this one: {self.context.cp}).")
        x = self._embed(tokens, cache.length)
        for layer, layer_cache in zip(self.layers, cache.layers):
            x = layer.decode(x, layer_cache)
        cache.advance(tokens.shape[1])
        return self._full_vocabulary(self.lm_head(self.final_norm(x))[-1])

    @torch.no_grad()
    def next_token_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [b, V] of the last position of `tokens` [b, s], without a cache."""
        if self.context.cp > 1:  # each cp rank holds a part of the sequence, not its last token
            raise ValueError(f"next_token_logits needs context parallel size 1 (this model: {self.context.cp}): "
                             "build the generating model with cp_group of one rank.")
        return self._full_vocabulary(self.forward(tokens)[-1])

    def _full_vocabulary(self, local: torch.Tensor) -> torch.Tensor:
        """[b, V_padded/p] on each rank -> [b, V] on every rank (gathered across the group), float32."""
        return mappings.gather_from_tensor_parallel_region(local, self.tp_group)[:, :self.vocab_size].float()

    @torch.no_grad()
    def canonical_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, p-independent weights on every rank (a collective over the tensor-parallel group)."""
        canonical = {}
        for key, (param, kind) in parameter_kinds(self).items():
            dim = kind.dim if isinstance(kind, Sharded) else getattr(kind, "sharded_dim", None)
            if dim is None:  # the same on every rank (experts split over ep: all of them, in global order)
                shards = [expert_shards.whole(param, kind)] * self.tp_size
            else:
                gathered = collectives.all_gather_along_dim(param.detach(), dim, self.tp_group)
                shards = list(gathered.chunk(self.tp_size, dim))
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
        shapes = {"embed_tokens.weight": (self.vocab_size, h)} if self.embed_tokens is not None else {}
        if self.embed_positions is not None:
            shapes["embed_positions.weight"] = tuple(self.embed_positions.shape)
        for i, layer in zip(self.layers.global_indices(), self.layers):
            for part in ("input_norm", "post_attention_norm"):
                shapes.update({f"layers.{i}.{part}.{k}": tuple(v.shape)
                               for k, v in getattr(layer, part).state_dict().items()})
            shapes.update({f"layers.{i}.attention.{k}": v for k, v in layer.attention.canonical_shapes().items()})
            shapes.update({f"layers.{i}.mlp.{k}": v for k, v in layer.mlp.canonical_shapes().items()})
        if self.final_norm is None:
            return shapes
        shapes.update({f"final_norm.{k}": tuple(v.shape) for k, v in self.final_norm.state_dict().items()})
        if not self.config.tie_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes
