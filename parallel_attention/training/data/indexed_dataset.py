"""Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`, the "MMIDIDX" index), written and read here.

The format is the one `megatron.core.datasets.indexed_dataset` reads, so that data prepared by Megatron-LM or NeMo
trains here unchanged and data prepared here trains there. It is written from its description, not from their code
(megatron-core is no dependency):

    PREFIX.bin   every sequence's tokens, concatenated, raw little-endian in the index's dtype
    PREFIX.idx   b"MMIDIDX\\x00\\x00", version <Q = 1, dtype code <B, sequence count <Q, document-index count <Q,
                 then sequence lengths (int32 [n]), byte pointers into .bin (int64 [n]), and the document indices
                 (int64 [d]): 0, then after each document the number of sequences so far

Here each document is one sequence that ends with the tokenizer's end-of-text id, as Megatron's preprocess_data.py
writes with --append-eod. The dtype is uint16 below 65,500 tokens of vocabulary (Megatron's rule), else int32.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ...checkpointing.tensor_io import fsync_dir
from ..config.checks import ConfigError

__all__ = ["IndexedDatasetWriter", "IndexedTokens", "IndexFormatError", "token_dtype"]

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron's dtype codes
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
_CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}
_UINT16_BELOW = 65_500  # Megatron's optimal_dtype: uint16 for a vocabulary under this many tokens
_PIECE = 1 << 22  # index entries read at a time: 32 MB of int64


class IndexFormatError(ConfigError):
    """A .bin / .idx pair that is not a readable indexed dataset; the message names the file and the fix."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The token dtype of a vocabulary: uint16 where it fits (with Megatron's margin), else int32."""
    return np.dtype("<u2" if vocab_size < _UINT16_BELOW else "<i4")


class IndexedDatasetWriter:
    """Append documents to `PREFIX.bin.tmp` as they come; `finish()` writes the index and renames both into place.

    Only the per-document lengths stay in memory (4 bytes a document), never the tokens: a shard of a billion
    tokens needs a few MB here. Until `finish()` nothing exists under the final names, so a killed writer leaves
    only `.tmp` files, which the next attempt overwrites.
    """

    def __init__(self, prefix, dtype: np.dtype) -> None:
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype).newbyteorder("<")
        if np.dtype(dtype) not in _CODE_OF:
            raise ValueError(f"dtype {dtype} has no indexed-dataset code: use one of {sorted(map(str, _CODE_OF))}.")
        self._tmp_bin = self.prefix.with_name(self.prefix.name + ".bin.tmp")
        self._bin = open(self._tmp_bin, "wb")
        self.lengths: list[int] = []
        self.num_tokens = 0

    def add_document(self, tokens: np.ndarray) -> None:
        """One document as one sequence (its end-of-text id already appended by the caller)."""
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self.lengths.append(len(tokens))
        self.num_tokens += len(tokens)

    def finish(self) -> None:
        """Write PREFIX.idx, fsync both files, then rename them into place (.bin first: the .idx names it done)."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.asarray(self.lengths, dtype="<i4")
        pointers = np.zeros(len(lengths), dtype="<i8")
        np.cumsum(lengths[:-1].astype("<i8") * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(len(lengths) + 1, dtype="<i8")
        tmp_idx = self.prefix.with_name(self.prefix.name + ".idx.tmp")
        with open(tmp_idx, "wb") as f:
            f.write(HEADER + struct.pack("<Q", VERSION) + struct.pack("<B", _CODE_OF[np.dtype(self.dtype)]))
            f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(documents)))
            for array in (lengths, pointers, documents):
                f.write(array.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._tmp_bin, self.prefix.with_name(self.prefix.name + ".bin"))
        os.replace(tmp_idx, self.prefix.with_name(self.prefix.name + ".idx"))
        fsync_dir(self.prefix.parent)

    def abandon(self) -> None:
        """Close and delete the temporary file (a failed preparation)."""
        self._bin.close()
        self._tmp_bin.unlink(missing_ok=True)


class IndexedTokens:
    """One indexed dataset, memory-mapped: its token stream and where each document starts in it.

    `tokens` is the whole .bin as one array (documents back to back, as the sequences lie on disk);
    `boundaries()` gives the token offset where each document starts (and, last, the total), in pieces, so that
    document i is tokens[b[i]:b[i + 1]]. A document of several sequences (Megatron's sentence-split data) is one
    document here: its sequences are contiguous in .bin; an empty document (a repeated document index) is none.

    Opening reads only the header; `check_index=True` also reads the whole index in pieces of _PIECE entries
    (memory O(1) in the corpus) and refuses one that does not describe its .bin. An index cache (index_cache.py)
    checks once, when it is built, and opens with `check_index=False` afterwards.
    """

    def __init__(self, prefix, check_index: bool = True) -> None:
        self.prefix = Path(prefix)
        self.idx_path, self.bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise IndexFormatError(f"{path} does not exist: an indexed dataset is a PREFIX.bin and PREFIX.idx "
                                       f"pair; give its prefix without the extension ({self.prefix}).")
        self.dtype, self._lengths, self._pointers, self._documents = _read_index(self.idx_path)
        self.num_sequences = len(self._lengths)
        self._num_documents, self._starts = None, None
        if check_index:
            self.num_tokens = sum(int(p.sum(dtype=np.int64)) for p in _pieces(self._lengths))
        else:  # back to back (checked when the cache was built): the last pointer and length give the total
            self.num_tokens = (int(self._pointers[-1]) // self.dtype.itemsize + int(self._lengths[-1])
                               if self.num_sequences else 0)
        expected = self.num_tokens * self.dtype.itemsize
        if self.bin_path.stat().st_size != expected:
            raise IndexFormatError(f"{self.bin_path} has {self.bin_path.stat().st_size} bytes but {self.idx_path} "
                                   f"describes {expected} ({self.num_tokens} tokens of {self.dtype}): the pair does "
                                   "not belong together or one was cut short; prepare it again.")
        if check_index:
            self._check_pointers()
            self._num_documents = self._check_documents()
        self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,)) \
            if self.num_tokens else np.zeros(0, dtype=self.dtype)

    def _check_pointers(self) -> None:
        itemsize, expected = self.dtype.itemsize, 0
        for lengths, pointers in zip(_pieces(self._lengths), _pieces(self._pointers)):
            steps = lengths.astype(np.int64) * itemsize
            if pointers[0] != expected or np.any(np.diff(pointers) != steps[:-1]):
                raise IndexFormatError(f"{self.idx_path}: its sequences are not back to back in {self.bin_path}, "
                                       "which this reader needs (every Megatron-LM and NeMo writer lays them out so).")
            expected = int(pointers[-1]) + int(steps[-1])

    def _check_documents(self) -> int:
        """The number of non-empty documents, once the document indices are found to run from 0 to the count."""
        documents, n = self._documents, self.num_sequences
        bad = len(documents) == 0 or documents[0] != 0 or documents[-1] != n
        previous, distinct = 0, 1 if len(documents) else 0
        for piece in ([] if bad else _pieces(documents)):
            steps = np.diff(piece, prepend=previous)
            bad, previous, distinct = bool(np.any(steps < 0)), int(piece[-1]), distinct + int(np.count_nonzero(steps))
            if bad:
                break
        if bad:
            raise IndexFormatError(f"{self.idx_path}: its document indices do not run from 0 to its "
                                   f"{n} sequences: the index is damaged; prepare it again.")
        return distinct - 1

    @property
    def num_documents(self) -> int:
        if self._num_documents is None:
            self._num_documents = self._check_documents()
        return self._num_documents

    def boundaries(self):
        """The documents' token offsets in pieces: each piece starts where the last ended (its first entry is the
        previous piece's last), so a piece b holds the documents b[:-1] .. b[1:]."""
        last_sequence, last_offset = None, None
        for piece in _pieces(self._documents):
            keep = np.empty(len(piece), dtype=bool)
            keep[0] = last_sequence is None or piece[0] != last_sequence
            np.not_equal(piece[1:], piece[:-1], out=keep[1:])
            sequences, last_sequence = piece[keep], int(piece[-1])
            offsets = np.full(len(sequences), self.num_tokens, dtype=np.int64)
            inside = sequences < self.num_sequences
            offsets[inside] = self._pointers[sequences[inside]] // self.dtype.itemsize
            if last_offset is not None:
                offsets = np.concatenate([[last_offset], offsets])
            if len(offsets):
                last_offset = int(offsets[-1])
                yield offsets

    @property
    def document_starts(self) -> np.ndarray:
        """int64 [num_documents + 1]: every boundary at once (memory grows with the corpus: for tests and tools)."""
        if self._starts is None:
            pieces = list(self.boundaries())
            self._starts = np.concatenate([pieces[0]] + [p[1:] for p in pieces[1:]])
        return self._starts

    def document(self, index: int) -> np.ndarray:
        starts = self.document_starts
        return self.tokens[starts[index]:starts[index + 1]]


def _pieces(array: np.ndarray):
    """`array` (a memory map) in pieces of _PIECE entries, each read into memory."""
    for lo in range(0, len(array), _PIECE):
        yield np.asarray(array[lo:lo + _PIECE])


def _read_index(path: Path) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(dtype, sequence lengths, byte pointers, document indices) of a .idx file, each checked."""
    with open(path, "rb") as f:
        head = f.read(len(HEADER) + 8 + 1 + 8 + 8)
    if len(head) < len(HEADER) + 25 or head[:len(HEADER)] != HEADER:
        raise IndexFormatError(f"{path} is not a Megatron-LM indexed-dataset index (its first bytes are not "
                               f"{HEADER!r}): give the prefix of a .bin/.idx pair written by preprocess_data.py, "
                               "NeMo or scripts/prepare_data.py.")
    version, code, count, doc_count = struct.unpack("<QBQQ", head[len(HEADER):])
    if version != VERSION or code not in DTYPE_CODES:
        raise IndexFormatError(f"{path}: index version {version}, dtype code {code}; this reader knows version "
                               f"{VERSION} and codes {sorted(DTYPE_CODES)}.")
    dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
    offset = len(head)
    needed = offset + count * 12 + doc_count * 8
    if path.stat().st_size < needed:
        raise IndexFormatError(f"{path} has {path.stat().st_size} bytes, fewer than the {needed} its header "
                               "announces: the file was cut short; prepare it again.")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(raw, dtype="<i4", count=count, offset=offset)
    pointers = np.frombuffer(raw, dtype="<i8", count=count, offset=offset + count * 4)
    documents = np.frombuffer(raw, dtype="<i8", count=doc_count, offset=offset + count * 12)
    return dtype, lengths, pointers, documents
