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
    `document_starts[i]` is the token offset of document i and `document_starts[-1]` the total, so document i is
    tokens[document_starts[i]:document_starts[i + 1]]. A document of several sequences (Megatron's sentence-split
    data) is one document here: its sequences are contiguous in .bin.
    """

    def __init__(self, prefix) -> None:
        self.prefix = Path(prefix)
        self.idx_path, self.bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise IndexFormatError(f"{path} does not exist: an indexed dataset is a PREFIX.bin and PREFIX.idx "
                                       f"pair; give its prefix without the extension ({self.prefix}).")
        self.dtype, lengths, pointers, documents = _read_index(self.idx_path)
        self.num_sequences = len(lengths)
        self.num_tokens = int(lengths.sum(dtype=np.int64))
        expected = self.num_tokens * self.dtype.itemsize
        if self.bin_path.stat().st_size != expected:
            raise IndexFormatError(f"{self.bin_path} has {self.bin_path.stat().st_size} bytes but {self.idx_path} "
                                   f"describes {expected} ({self.num_tokens} tokens of {self.dtype}): the pair does "
                                   "not belong together or one was cut short; prepare it again.")
        steps = lengths[:-1].astype(np.int64) * self.dtype.itemsize
        if len(lengths) and (pointers[0] != 0 or np.any(np.diff(pointers) != steps)):
            raise IndexFormatError(f"{self.idx_path}: its sequences are not back to back in {self.bin_path}, which "
                                   "this reader needs (every Megatron-LM and NeMo writer lays them out so).")
        sequence_starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=sequence_starts[1:])
        if len(documents) == 0 or documents[0] != 0 or documents[-1] != len(lengths) or np.any(np.diff(documents) < 0):
            raise IndexFormatError(f"{self.idx_path}: its document indices do not run from 0 to its "
                                   f"{len(lengths)} sequences: the index is damaged; prepare it again.")
        bounds = documents if np.all(np.diff(documents) > 0) else np.unique(documents)  # empty documents dropped
        self.document_starts = sequence_starts[bounds]
        self.num_documents = len(self.document_starts) - 1
        self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,)) \
            if self.num_tokens else np.zeros(0, dtype=self.dtype)

    def document(self, index: int) -> np.ndarray:
        return self.tokens[self.document_starts[index]:self.document_starts[index + 1]]


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
