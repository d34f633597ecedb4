"""Batches from token files, as a pure function of (seed, step).

The offsets of a global batch's windows are drawn from a generator seeded with (seed, step), and
data-parallel rank r takes rows [r*n/dp, (r+1)*n/dp). Ranks of one tensor-parallel group (same dp rank)
therefore see identical batches, the union over dp ranks is the same global batch for any layout, and a
resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..transformer.cross_entropy import IGNORE_INDEX
from ..transformer.documents import mask_cross_document_labels

if TYPE_CHECKING:
    from .data import TokenDataset

__all__ = ["GlobalBatchSampler", "validation_batches"]


def _check_fits(dataset: TokenDataset, seq_len: int) -> None:
    if dataset.num_tokens < seq_len + 1:
        raise ValueError(f"the split holds {dataset.num_tokens} tokens, fewer than seq_len+1={seq_len + 1}: "
                         f"use a shorter data.seq_len, a larger corpus or a larger data.val_fraction.")


def _split_rows(rows: torch.Tensor, micro_batch_size: int,
                documents: torch.Tensor | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Cut [n, s+1] rows into micro-batches of (tokens [mb, s], labels [mb, s]), labels shifted by one; with
    `documents` [n, s+1] (each token's document index), (tokens, labels, document_ids [mb, s]) whose labels
    that predict the next document's first token are IGNORE_INDEX (packed documents: data.document_masking)."""
    if documents is None:
        return [(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()) for chunk in rows.split(micro_batch_size)]
    return [(chunk[:, :-1].contiguous(),
             mask_cross_document_labels(chunk[:, 1:].contiguous(), docs[:, 1:], docs[:, :-1], IGNORE_INDEX),
             docs[:, :-1].contiguous()) for chunk, docs in zip(rows.split(micro_batch_size),
                                                               documents.split(micro_batch_size))]


def window_documents(dataset: TokenDataset, offsets, length: int) -> torch.Tensor:
    """LongTensor [len(offsets), length]: the index of the document (train.idx / val.idx) of each token."""
    if dataset.doc_offsets is None:
        raise ValueError(f"data.document_masking=true needs the document index beside {dataset.path} (its .idx): "
                         "this data was prepared without one; prepare it again (delete its meta.json).")
    positions = np.asarray(offsets, dtype=np.int64).reshape(-1, 1) + np.arange(length, dtype=np.int64)
    return torch.from_numpy(np.searchsorted(dataset.doc_offsets, positions, side="right").astype(np.int64) - 1)


def _micro_batches(dataset: TokenDataset, offsets, length: int, micro_batch_size: int,
                   document_masking: bool) -> list[tuple[torch.Tensor, ...]]:
    documents = window_documents(dataset, offsets, length) if document_masking else None
    return _split_rows(dataset.windows(offsets, length), micro_batch_size, documents)


class GlobalBatchSampler:
    """Global batches of `global_batch_size` random windows of seq_len+1 tokens, a pure function of (seed, step)."""

    def __init__(self, dataset: TokenDataset, seq_len: int, global_batch_size: int, seed: int,
                 document_masking: bool = False) -> None:
        """document_masking: micro-batches are (tokens, labels, document_ids) with the labels across a
        document boundary ignored (data.document_masking)."""
        _check_fits(dataset, seq_len)
        self.dataset, self.seq_len, self.global_batch_size, self.seed = dataset, seq_len, global_batch_size, seed
        self.document_masking = document_masking
        if document_masking:
            window_documents(dataset, [0], 1)  # refused now, not at the first step, without a document index

    def offsets(self, step: int) -> torch.Tensor:
        """Start offsets of the global batch of `step`; cheap, so every rank computes all of them."""
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + step) % (1 << 63))
        high = self.dataset.num_tokens - self.seq_len  # last valid start + 1
        return torch.randint(0, high, (self.global_batch_size,), generator=generator)

    def global_batch(self, step: int) -> torch.Tensor:
        """LongTensor [global_batch_size, seq_len + 1]."""
        return self.dataset.windows(self.offsets(step), self.seq_len + 1)

    def local_micro_batches(self, step: int, dp_rank: int, dp_size: int,
                            micro_batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This data-parallel rank's rows of the global batch, as (tokens, labels) micro-batches [mb, seq_len].

        Only this rank's rows are read from disk.
        """
        per_rank = _rows_per_rank(self.global_batch_size, dp_rank, dp_size, micro_batch_size)
        mine = self.offsets(step)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        return _micro_batches(self.dataset, mine, self.seq_len + 1, micro_batch_size, self.document_masking)


def _rows_per_rank(batch_size: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> int:
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size}).")
    if batch_size % (dp_size * micro_batch_size) != 0:
        raise ValueError(f"batch size {batch_size} is not a multiple of micro_batch_size={micro_batch_size} x "
                         f"data-parallel size {dp_size}.")
    return batch_size // dp_size


def validation_batches(dataset: TokenDataset, seq_len: int, batch_size: int, num_batches: int, *,
                       dp_rank: int = 0, dp_size: int = 1,
                       document_masking: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """This data-parallel rank's part of a fixed validation set of `num_batches` x `batch_size` windows.

    The windows are evenly spaced over the split and do not depend on the layout: the trainer passes
    `batch_size = training.micro_batch_size`, whatever the data-parallel size. Rank r takes rows
    [r*b//dp, (r+1)*b//dp) of every batch (fewer than one row per rank leaves some ranks without that
    batch), so sum the token losses and the token counts over the ranks, then divide, for a mean that
    is the same for every layout.
    """
    _check_fits(dataset, seq_len)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size}).")
    starts = np.linspace(0, dataset.num_tokens - seq_len - 1, batch_size * num_batches).round().astype(np.int64)
    first, last = dp_rank * batch_size // dp_size, (dp_rank + 1) * batch_size // dp_size
    batches = []
    for b in range(num_batches):
        mine = starts[b * batch_size + first: b * batch_size + last]
        if len(mine):
            batches += _micro_batches(dataset, mine, seq_len + 1, len(mine), document_masking)
    return batches
