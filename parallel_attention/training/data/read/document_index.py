"""A source's training and validation streams as arrays on disk, written in pieces and memory-mapped when read.

A stream (token_source.TokenStream) is a list of segments, one per document: segment k is the document
`document[k]`, whose tokens start at `source[k]` in the source's token space, and it starts at `starts[k]` in
the stream (`starts[-1]` is the stream's length). These are 24 bytes a document: 24 GB at 10^9 documents, too much
for every rank to hold. So they are written once, document piece by document piece (memory O(1) in the corpus),
as `.npy` files (`train_starts.npy`, `train_source.npy`, `train_document.npy`, and `val_*`), which every rank
opens with np.load(mmap_mode="r"): a step's read touches only the pages its windows need (a binary search in
`starts`), and a rank's memory no longer grows with the corpus.

Beside them, `train_coarse.npy` holds every COARSE-th entry of `starts` (a few MB at 10^9 documents), read
into memory: a window's segment is found in it first, then in one COARSE-entry slice of `starts`, so a lookup
reads a page or two of the map instead of the ~30 scattered ones of a binary search over all of it (each a read
on a network filesystem).

The values are those the previous in-memory build held, so batches are unchanged: every ~1/val_fraction-th
document is validation (document_split); a source of a single document gives its last val_fraction of tokens to
validation.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path

import numpy as np

from ..document_split import validation_range
from ..indexed_dataset import IndexedTokens
from ..token_files import DataFileError

__all__ = ["COARSE", "SPLITS", "load_stream", "write_streams"]

SPLITS = ("train", "val")
COARSE = 4096  # entries of `starts` per entry of the in-memory coarse index
_FIELDS = ("starts", "source", "document")


def _count_validation(num_documents: int, val_fraction: float, piece: int = 1 << 24) -> int:
    return sum(int(np.count_nonzero(validation_range(num_documents, val_fraction, lo, min(lo + piece, num_documents))))
               for lo in range(0, num_documents, piece))


class _Writer:
    """One split's three arrays, appended in order to .npy files whose header (their final shape) comes first:
    plain writes, so the build's memory holds one piece, not the pages of a growing map."""

    def __init__(self, directory: Path, split: str, count: int) -> None:
        self.files = []
        for field in _FIELDS:
            f = open(directory / f"{split}_{field}.npy", "wb")
            shape = (count + 1,) if field == "starts" else (count,)
            np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": shape})
            self.files.append(f)
        self.files[0].write(np.zeros(1, dtype="<i8").tobytes())
        self.end, self.written = 0, 1  # the stream's length so far; entries of `starts` written
        self.coarse, self.path = [np.zeros(1, dtype=np.int64)], directory / f"{split}_coarse.npy"

    def add(self, source: np.ndarray, lengths: np.ndarray, documents: np.ndarray) -> None:
        ends = self.end + np.cumsum(lengths, dtype=np.int64)
        for f, values in zip(self.files, (ends, source, documents)):
            f.write(np.ascontiguousarray(values, dtype="<i8").tobytes())
        if len(ends):
            self.end = int(ends[-1])
            self.coarse.append(ends[(self.written + np.arange(len(ends))) % COARSE == 0])
            self.written += len(ends)

    def close(self) -> int:
        np.save(self.path, np.concatenate(self.coarse))
        for f in self.files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        return self.end


def write_streams(directory: Path, shards: list[IndexedTokens], val_fraction: float,
                  name: str) -> Generator[str, None, dict]:
    """Write both splits' arrays of the documents of `shards` (in order) into `directory`, yielding how far it is
    (the caller reports it: nothing here calls back into it); returns their counts (`info = yield from ...`)."""
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
            yield f"{document:,} of {num_documents:,} documents indexed"
        base += shard.num_tokens
    tokens = {split: writer.close() for split, writer in writers.items()}
    return {"num_documents": num_documents, "coarse": COARSE,
            **{f"num_{split}_tokens": tokens[split] for split in SPLITS}}


def load_stream(directory: Path, split: str) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """((starts, source, document) of `split`, memory-mapped read-only; its coarse index, in memory)."""
    return (tuple(np.load(directory / f"{split}_{field}.npy", mmap_mode="r") for field in _FIELDS),
            np.load(directory / f"{split}_coarse.npy"))
