"""A transformers model's token embedding and output head, split by vocabulary rows.

    tokens [b, s]   -> VocabParallelEmbedding (rows of r; forward all-reduce, backward identity) -> [b, s, h]
    x [b, s, h]     -> VocabParallelHead: Y_r^T = E_r x^T (backward all-reduce dX), all-gathered along the
                       vocabulary (`vocab_major_head`) -> full-vocabulary logits [b, s, V] (`.logits`, generate):
                       a view of the gathered [V, b s] buffer, not row-major (`.contiguous()` makes them so).
                       Y_r is pinned to them: the model's loss reads Y_r alone (`tp_loss`), so its gradient never
                       spans the vocabulary

The table is padded with zero rows to V_padded (`sharding.padded_vocab_size`, the one rule GPTModel uses too); the
padding's logits are cut off after the gather. With tied embeddings the head holds the embedding's very Parameter (one shard, one gradient).
"""

from __future__ import annotations

import torch

from ..tensor_parallel.collectives import all_gather_along_dim
from ..tensor_parallel.layers import OutputLinear, VocabParallelEmbedding
from ..tensor_parallel.linear_functions import column_parallel_linear
from ..tensor_parallel.parallel_state import group_rank, group_size
from ..tensor_parallel.sharding import padded_vocab_size, vocab_shard, vocab_unshard
from .tp_loss import attach_shard
from .vocab_major_head import vocab_major_logits


class HFVocabParallelEmbedding(VocabParallelEmbedding):
    """The token embedding of a transformers model, rows split (and padded) across the group."""

    def __init__(self, table: torch.Tensor, group) -> None:
        p = group_size(group)
        super().__init__(padded_vocab_size(table.shape[0], p), table.shape[1], init_std=None, tp_group=group,
                         dtype=table.dtype, device=table.device)
        self.vocab_size = table.shape[0]
        with torch.no_grad():
            self.weight.copy_(vocab_shard(table.detach(), self.num_embeddings, p, group_rank(group)))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {"weight": full_table(self.weight, self.tp_group, self.vocab_size)}


class VocabParallelHead(OutputLinear):
    """The output head: this rank's vocabulary rows, logits gathered to the full vocabulary (in high precision
    under FP8 too)."""

    def __init__(self, table: torch.Tensor, group) -> None:
        p = group_size(group)
        super().__init__(table.shape[1], padded_vocab_size(table.shape[0], p), bias=False, gather_output=True,
                         init_std=None, tp_group=group, dtype=table.dtype, device=table.device)
        self.vocab_size = table.shape[0]
        with torch.no_grad():
            self.weight.copy_(vocab_shard(table.detach(), self.out_features, p, group_rank(group)))
        self._logits = self._gathered if p > 1 else self._whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._logits(x)

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        """p = 1: the logits are the GEMM's output over the table's first V rows (the padding is not read), so
        transformers' loss reads them directly."""
        return column_parallel_linear(x, self.weight[:self.vocab_size], self.bias, self.comm, self.precision)

    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        full, local = vocab_major_logits(x.reshape(-1, x.shape[-1]), self.weight, self.tp_group)
        logits = full[:self.vocab_size].t().view(*x.shape[:-1], self.vocab_size)
        attach_shard(logits, local.t().view(*x.shape[:-1], local.shape[0]))
        return logits

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {"weight": full_table(self.weight, self.tp_group, self.vocab_size)}


def full_table(weight: torch.Tensor, group, vocab_size: int) -> torch.Tensor:
    """The [V, h] table from every rank's rows, padding dropped (a collective)."""
    return vocab_unshard([all_gather_along_dim(weight.detach(), 0, group)], vocab_size)
