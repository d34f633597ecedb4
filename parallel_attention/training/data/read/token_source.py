"""One source of a blend, opened for reading: its documents, split into a training and a validation stream.

A source is a directory this project prepared (shards of Megatron-LM's indexed format and a meta.json, or the
previous release's train.bin / val.bin), or a Megatron-LM prefix (`/data/pile/pile_text_document` for the
`.bin` + `.idx` pair that preprocess_data.py or NeMo wrote). Its documents, shard after shard, form one token
space; `document_split.validation_mask` holds every ~1/val_fraction-th document out for validation (the previous
format keeps the split it was prepared with). Each stream is the concatenation of its documents' tokens, read
through `TokenStream`: windows may cross document boundaries, and each token's document index is known, so
`data.document_masking` still masks them.

Opening reads no corpus: the per-document arrays come memory-mapped from the source's index cache (source_index),
built once, and each 64 MiB chunk of a .bin is verified the first time this process reads from it (chunk_hashes).
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..chunk_hashes import ChunkVerifier
from ..indexed_dataset import IndexedTokens
from .source_index import index_streams, megatron_index, prepared_index
from ..previous_format import read_splits
from ..token_files import DataFileError, is_previous_format, meta_and_reason, prepare_again, verify_at_start

__all__ = ["TokenSource", "TokenStream", "open_source"]


class TokenStream:
    """Segments of a source's token space read as one stream: segment k is the tokens
    [segment_source[k], segment_source[k] + segment_starts[k + 1] - segment_starts[k]) of the source, from its
    document segment_document[k], and starts at segment_starts[k] in the stream (document_index.py)."""

    def __init__(self, shards: list[tuple[np.ndarray, Path]], segments: tuple, vocab: tuple[int, str], name: str,
                 verifiers: list[ChunkVerifier | None] | None = None,
                 coarse: tuple[int, np.ndarray] | None = None) -> None:
        """shards: each shard's tokens and file; segments: (segment_starts, segment_source, segment_document),
        memory-mapped or in memory; vocab: (size, where that size comes from) for the id check; verifiers: each
        shard's chunk verifier (None: its file was verified at start); coarse: (stride, segment_starts[::stride])
        for memory-mapped starts (document_index.py), None to search them whole."""
        self.shards, (self.vocab_size, self.vocab_from), self.name = shards, vocab, name
        self.coarse = coarse
        self.verifiers = verifiers or [None] * len(shards)
        self.shard_starts = np.cumsum([0] + [len(s) for s, _ in shards], dtype=np.int64)
        self.segment_starts, self.segment_source, self.segment_document = segments
        self.num_tokens = int(self.segment_starts[-1])

    @classmethod
    def in_memory(cls, shards, starts, lengths, documents, vocab: tuple[int, str], name: str) -> TokenStream:
        """A stream of few segments held in memory (the previous format's train.bin / val.bin)."""
        segment_starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=segment_starts[1:])
        return cls(shards, (segment_starts, np.asarray(starts, dtype=np.int64), np.asarray(documents, np.int64)),
                   vocab, name)

    def _locate(self, offsets, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(source-level position, segment) of every token of the windows [offset, offset + length)."""
        positions = np.asarray(offsets, dtype=np.int64).reshape(-1, 1) + np.arange(length, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.num_tokens):
            raise IndexError(f"a window of {length} tokens at {positions.min()} leaves the {self.num_tokens}-token "
                             f"stream of {self.name}.")
        segment = self._segments(positions)
        return self.segment_source[segment] + (positions - self.segment_starts[segment]), segment

    def _segments(self, positions: np.ndarray) -> np.ndarray:
        """The segment of each position: the last k with segment_starts[k] <= position, found in the coarse
        index, then in one stride of the map (the same k as a search of all of it)."""
        if self.coarse is None:
            return np.searchsorted(self.segment_starts, positions, side="right") - 1
        stride, coarse = self.coarse
        block = np.searchsorted(coarse, positions, side="right") - 1
        segment = np.empty(positions.shape, dtype=np.int64)
        for b in np.unique(block):
            chosen, first = block == b, int(b) * stride
            part = np.asarray(self.segment_starts[first:first + stride + 1])
            segment[chosen] = first + np.searchsorted(part, positions[chosen], side="right") - 1
        return segment

    def windows(self, offsets, length: int) -> np.ndarray:
        """int64 [len(offsets), length]: the tokens of each window, every id checked against the vocabulary."""
        source_positions, _ = self._locate(offsets, length)
        rows = np.empty(source_positions.shape, dtype=np.int64)
        shard = np.searchsorted(self.shard_starts, source_positions, side="right") - 1
        for s in np.unique(shard):
            chosen = shard == s
            (tokens, path), verifier = self.shards[s], self.verifiers[s]
            positions = source_positions[chosen] - self.shard_starts[s]
            if verifier is not None:
                verifier.check_tokens(positions)
            rows[chosen] = values = tokens[positions]
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
    index: dict | None = None  # its index cache's info.json (source_index.py); None for the previous format


def open_source(path: str, val_fraction: float, tokenizer: tuple[int, str], verify: bool = True,
                index_cache: Path | None = None) -> TokenSource:
    """Open a prepared directory or a Megatron-LM prefix, verifying every file it reads against meta.json.

    `tokenizer`: the run's (vocabulary size, data.tokenizer), which a Megatron-LM prefix's ids are checked
    against; a prepared directory's are checked against the vocabulary its meta.json records. `index_cache`: where
    a Megatron-LM prefix's index cache goes (and a read-only prepared directory's); None: a private temporary
    directory, gone when the source is closed (built anew each time). `verify=False` skips the start's checks
    and the chunks' (tests that read damaged files)."""
    if index_cache is None:
        with tempfile.TemporaryDirectory(prefix="index_cache-") as root:  # the maps keep the files readable
            return open_source(path, val_fraction, tokenizer, verify, Path(root))
    if Path(path).is_dir():
        meta, why = meta_and_reason(path)
        if meta is None:
            raise DataFileError(f"{path} holds no complete prepared data ({why}): {prepare_again(path)}.")
        if verify:
            verify_at_start(path, meta)
        if is_previous_format(meta):
            return _previous_format(path, meta)
        vocab = (int(meta["vocab_size"]), f"the tokenizer {meta['tokenizer']} ({Path(path) / 'meta.json'})")
        directory, info = prepared_index(Path(path), meta, val_fraction, Path(index_cache))
        return _from_cache(path, directory, info, vocab, meta, verify, functools.partial(prepare_again, path, meta))
    if Path(f"{path}.idx").is_file() or Path(f"{path}.bin").is_file():
        directory, info = megatron_index(Path(path), val_fraction, Path(index_cache))
        fix = (f"if the change is wanted, delete {directory} (the index and its hashes are then made anew); else "
               f"restore {path}.bin")
        return _from_cache(path, directory, info, tokenizer, None, verify, fix)
    raise DataFileError(f"the data path {path!r} (data.blend or data.data_dir) is neither a prepared data directory "
                        f"nor a Megatron-LM prefix ({path}.bin + {path}.idx): give a directory that "
                        "scripts/prepare_data.py wrote, or a prefix without its extension.")


def _from_cache(name: str, directory: Path, info: dict, vocab: tuple[int, str], meta: dict | None, verify: bool,
                fix) -> TokenSource:
    """The source whose streams and chunk hashes its index cache `directory` holds; `fix`: the refusal's fix, or the
    function that says it (ChunkVerifier)."""
    prefixes = [Path(name) / s["prefix"] for s in meta["shards"]] if meta is not None else [Path(name)]
    shards, verifiers = [], []
    for prefix, shard in zip(prefixes, info["shards"]):
        tokens = IndexedTokens(prefix, check_index=False)
        shards.append((tokens.tokens, tokens.bin_path))
        verifiers.append(ChunkVerifier(tokens.bin_path, shard["chunk_bytes"], shard["chunk_sha256"],
                                       tokens.dtype.itemsize, fix)
                         if verify and shard["chunk_sha256"] is not None else None)
    streams = index_streams(directory)
    train, val = (TokenStream(shards, segments, vocab, name, verifiers, (info["coarse"], coarse))
                  for segments, coarse in streams)
    return TokenSource(name, train, val, vocab[0], meta, info["num_documents"], info)


def _previous_format(path: str, meta: dict) -> TokenSource:
    """The previous release's train.bin / val.bin (with train.idx / val.idx document offsets when present)."""
    vocab = (int(meta["vocab_size"]), f"the tokenizer {meta['tokenizer']} ({Path(path) / 'meta.json'})")
    streams = [TokenStream.in_memory([(tokens, bin_path)], starts, lengths, np.arange(len(starts)), vocab, path)
               for tokens, bin_path, starts, lengths in read_splits(path, meta)]
    return TokenSource(path, *streams, vocab[0], meta, int(meta.get("num_documents", 0)))
