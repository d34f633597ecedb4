"""A source's training and validation streams as arrays on disk, written in pieces and memory-mapped when read.

A stream (token_source.TokenStream) is a list of segments, one per document: segment k is the document
`document[k]`, whose tokens start at `source[k]` in the source's token space, and it starts at `starts[k]` in
the stream (`starts[-1]` is the stream's length). These are 24 bytes a document: 24 GB at 10^9 documents, too much
for every rank to hold. So they are written once, document piece by document piece (memory O(1) in the corpus),
as `.npy` files (`train_starts.npy`, `train_source.npy`, `train_document.npy`, and `val_*`), which every rank
opens with np.load(mmap_mode="r"): a step's read touches only the pages its windows need (a binary search in
`starts`), and a rank's memory no longer grows with the corpus.

The values are those the previous in-memory build held, so batches are unchanged: every ~1/val_fraction-th
document is validation (document_split); a source of a single document gives its last val_fraction of tokens to
validation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .document_split import validation_range
from .indexed_dataset import IndexedTokens
from .token_files import DataFileError

__all__ = ["SPLITS", "load_stream", "write_streams"]

SPLITS = ("train", "val")
_FIELDS = ("starts", "source", "document")


def _count_validation(num_documents: int, val_fraction: float, piece: int = 1 << 24) -> int:
    return sum(int(np.count_nonzero(validation_range(num_documents, val_fraction, lo, min(lo + piece, num_documents))))
               for lo in range(0, num_documents, piece))


class _Writer:
    """One split's three arrays, filled in order."""

    def __init__(self, directory: Path, split: str, count: int) -> None:
        self.arrays = [np.lib.format.open_memmap(directory / f"{split}_{field}.npy", mode="w+", dtype=np.int64,
                                                 shape=(count + 1 if field == "starts" else count,))
                       for field in _FIELDS]
        self.arrays[0][0], self.done = 0, 0

    def add(self, source: np.ndarray, lengths: np.ndarray, documents: np.ndarray) -> None:
        starts, sources, docs = self.arrays
        n, at = len(source), self.done
        sources[at:at + n], docs[at:at + n] = source, documents
        starts[at + 1:at + n + 1] = starts[at] + np.cumsum(lengths)
        self.done += n

    def close(self) -> int:
        for array in self.arrays:
            array.flush()
        tokens = int(self.arrays[0][-1])
        del self.arrays
        return tokens


def write_streams(directory: Path, shards: list[IndexedTokens], val_fraction: float, name: str,
                  progress) -> dict:
    """Write both splits' arrays of the documents of `shards` (in order) into `directory`; their counts."""
    num_documents = sum(s.num_documents for s in shards)
    if num_documents == 0:
        raise DataFileError(f"{name} holds no documents: point data.blend at a source with text.")
    num_val = 1 if num_documents == 1 else _count_validation(num_documents, val_fraction)
    writers = {split: _Writer(directory, split, count)
               for split, count in zip(SPLITS, (num_documents - num_val if num_documents > 1 else 1, num_val))}
    document, base = 0, 0
    for shard in shards:
        for bounds in shard.boundaries():
            starts, lengths = bounds[:-1] + base, np.diff(bounds)
            index = np.arange(document, document + len(starts), dtype=np.int64)
            if num_documents == 1 and len(starts):  # one document: its tokens are cut instead
                cut = max(1, int(round(int(lengths[0]) * val_fraction)))
                writers["train"].add(starts, lengths - cut, index)
                writers["val"].add(starts + lengths - cut, np.array([cut]), index)
            elif len(starts):
                held = validation_range(num_documents, val_fraction, document, document + len(starts))
                for split, chosen in zip(SPLITS, (~held, held)):
                    writers[split].add(starts[chosen], lengths[chosen], index[chosen])
            document += len(starts)
            progress(f"{document:,} of {num_documents:,} documents indexed")
        base += shard.num_tokens
    tokens = {split: writer.close() for split, writer in writers.items()}
    return {"num_documents": num_documents, **{f"num_{split}_tokens": tokens[split] for split in SPLITS}}


def load_stream(directory: Path, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, source, document) of `split`, memory-mapped read-only."""
    return tuple(np.load(directory / f"{split}_{field}.npy", mmap_mode="r") for field in _FIELDS)
