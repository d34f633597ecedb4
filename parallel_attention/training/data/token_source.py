"""One source of a blend, opened for reading: its documents, split into a training and a validation stream.

A source is a directory this project prepared (shards of Megatron-LM's indexed format and a meta.json, or the
previous release's train.bin / val.bin), or a Megatron-LM prefix (`/data/pile/pile_text_document` for the
`.bin` + `.idx` pair that preprocess_data.py or NeMo wrote). Its documents, shard after shard, form one token
space; `document_split.validation_mask` holds every ~1/val_fraction-th document out for validation (the previous
format keeps the split it was prepared with). Each stream is the concatenation of its documents' tokens, read
through `TokenStream`: windows may cross document boundaries, and each token's document index is known, so
`data.document_masking` still masks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .document_split import validation_mask
from .indexed_dataset import IndexedTokens
from .token_files import DataFileError, meta_and_reason, prepare_again, verify_files

__all__ = ["TokenSource", "TokenStream", "open_source"]


class TokenStream:
    """Segments of a source's token space read as one stream: segment i is `lengths[i]` tokens from `starts[i]`
    (source-level offsets) of document `documents[i]`."""

    def __init__(self, shards: list[tuple[np.ndarray, Path]], starts: np.ndarray, lengths: np.ndarray,
                 documents: np.ndarray, vocab: tuple[int, str], name: str) -> None:
        """shards: each shard's tokens and file; vocab: (size, where that size comes from) for the id check."""
        self.shards, (self.vocab_size, self.vocab_from), self.name = shards, vocab, name
        self.shard_starts = np.cumsum([0] + [len(s) for s, _ in shards], dtype=np.int64)
        self.segment_source = np.asarray(starts, dtype=np.int64)
        self.segment_document = np.asarray(documents, dtype=np.int64)
        self.segment_starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.segment_starts[1:])
        self.num_tokens = int(self.segment_starts[-1])

    def _locate(self, offsets, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(source-level position, segment) of every token of the windows [offset, offset + length)."""
        positions = np.asarray(offsets, dtype=np.int64).reshape(-1, 1) + np.arange(length, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.num_tokens):
            raise IndexError(f"a window of {length} tokens at {positions.min()} leaves the {self.num_tokens}-token "
                             f"stream of {self.name}.")
        segment = np.searchsorted(self.segment_starts, positions, side="right") - 1
        return self.segment_source[segment] + (positions - self.segment_starts[segment]), segment

    def windows(self, offsets, length: int) -> np.ndarray:
        """int64 [len(offsets), length]: the tokens of each window, every id checked against the vocabulary."""
        source_positions, _ = self._locate(offsets, length)
        rows = np.empty(source_positions.shape, dtype=np.int64)
        shard = np.searchsorted(self.shard_starts, source_positions, side="right") - 1
        for s in np.unique(shard):
            chosen = shard == s
            tokens, path = self.shards[s]
            rows[chosen] = values = tokens[source_positions[chosen] - self.shard_starts[s]]
            if values.size and (int(values.max()) >= self.vocab_size or int(values.min()) < 0):
                bad = int(values.max()) if int(values.max()) >= self.vocab_size else int(values.min())
                raise DataFileError(f"{path} holds token id {bad}, outside the vocabulary [0, {self.vocab_size}) of "
                                    f"{self.vocab_from}: the data was written with another tokenizer, or the file is "
                                    "damaged; prepare it again with this run's tokenizer, or set data.tokenizer to "
                                    "the one it was prepared with.")
        return rows

    def window_documents(self, offsets, length: int) -> np.ndarray:
        """int64 [len(offsets), length]: the source's document index of each token of each window."""
        return self.segment_document[self._locate(offsets, length)[1]]


@dataclass
class TokenSource:
    """A blend entry opened: `name` is its path as the config writes it."""

    name: str
    train: TokenStream
    val: TokenStream
    vocab_size: int
    meta: dict | None  # the prepared directory's meta.json; None for a Megatron-LM prefix
    num_documents: int


def open_source(path: str, val_fraction: float, tokenizer: tuple[int, str], verify: bool = True) -> TokenSource:
    """Open a prepared directory or a Megatron-LM prefix, verifying every file it reads against meta.json.

    `tokenizer`: the run's (vocabulary size, data.tokenizer), which a Megatron-LM prefix's ids are checked
    against; a prepared directory's are checked against the vocabulary its meta.json records."""
    if Path(path).is_dir():
        meta, why = meta_and_reason(path)
        if meta is None:
            raise DataFileError(f"{path} holds no complete prepared data ({why}): {prepare_again(path)}.")
        if verify:
            verify_files(path, meta)
        if "format_version" not in meta:
            return _previous_format(path, meta)
        prefixes = [Path(path) / shard["prefix"] for shard in meta["shards"]]
        vocab = (int(meta["vocab_size"]), f"the tokenizer {meta['tokenizer']} ({Path(path) / 'meta.json'})")
        return _from_indexed(path, [IndexedTokens(p) for p in prefixes], val_fraction, vocab, meta)
    if Path(f"{path}.idx").is_file() or Path(f"{path}.bin").is_file():
        vocab = (tokenizer[0], f"data.tokenizer={tokenizer[1]!r}")
        return _from_indexed(path, [IndexedTokens(path)], val_fraction, vocab, None)
    raise DataFileError(f"the data path {path!r} (data.blend or data.data_dir) is neither a prepared data directory "
                        f"nor a Megatron-LM prefix ({path}.bin + {path}.idx): give a directory that "
                        "scripts/prepare_data.py wrote, or a prefix without its extension.")


def _from_indexed(name: str, shards: list[IndexedTokens], val_fraction: float, vocab: tuple[int, str],
                  meta: dict | None) -> TokenSource:
    """Documents of every shard in order; every ~1/val_fraction-th is validation (one document: its tail)."""
    base = np.cumsum([0] + [s.num_tokens for s in shards[:-1]], dtype=np.int64)
    starts = np.concatenate([s.document_starts[:-1] + b for s, b in zip(shards, base)]) if shards else np.zeros(0)
    ends = np.concatenate([s.document_starts[1:] + b for s, b in zip(shards, base)]) if shards else np.zeros(0)
    starts, ends = starts.astype(np.int64), ends.astype(np.int64)
    tokens, vocab_size = [(s.tokens, s.bin_path) for s in shards], vocab[0]
    if len(starts) == 0:
        raise DataFileError(f"{name} holds no documents: point data.blend at a source with text.")
    if len(starts) == 1:  # a single document: its last val_fraction of tokens is validation
        cut = int(ends[0] - max(1, int(round((ends[0] - starts[0]) * val_fraction))))
        train = TokenStream(tokens, starts, [cut - starts[0]], [0], vocab, name)
        val = TokenStream(tokens, [cut], [ends[0] - cut], [0], vocab, name)
        return TokenSource(name, train, val, vocab_size, meta, 1)
    held = validation_mask(len(starts), val_fraction)
    index = np.arange(len(starts))
    streams = [TokenStream(tokens, starts[m], ends[m] - starts[m], index[m], vocab, name) for m in (~held, held)]
    return TokenSource(name, *streams, vocab_size, meta, len(starts))


def _previous_format(path: str, meta: dict) -> TokenSource:
    """The previous release's train.bin / val.bin (with train.idx / val.idx document offsets when present)."""
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    vocab = (int(meta["vocab_size"]), f"the tokenizer {meta['tokenizer']} ({Path(path) / 'meta.json'})")
    streams = []
    for split in ("train", "val"):
        count = int(meta[f"num_{split}_tokens"])
        tokens = np.memmap(Path(path) / f"{split}.bin", dtype=dtype, mode="r", shape=(count,))
        documents = meta.get(f"num_{split}_documents")
        starts = np.asarray(np.memmap(Path(path) / f"{split}.idx", dtype="<u8", mode="r", shape=(documents,)),
                            dtype=np.int64) if documents else np.zeros(1, dtype=np.int64)
        lengths = np.diff(np.append(starts, count))
        streams.append(TokenStream([(tokens, Path(path) / f"{split}.bin")], starts, lengths, np.arange(len(starts)),
                                   vocab, path))
    return TokenSource(path, *streams, vocab[0], meta, int(meta.get("num_documents", 0)))
