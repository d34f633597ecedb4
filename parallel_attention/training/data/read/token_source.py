"""A run's sources, opened for reading: each one's documents, split into a training and a validation stream, and
the blend of them checked against one tokenizer.

A source is a directory this project prepared (shards of Megatron-LM's indexed format and a meta.json, or the
previous release's train.bin / val.bin), or a Megatron-LM prefix (`/data/pile/pile_text_document` for the
`.bin` + `.idx` pair that preprocess_data.py or NeMo wrote). Its documents, shard after shard, form one token
space; `document_split.validation_mask` holds every ~1/val_fraction-th document out for validation (the previous
format keeps the split it was prepared with). Each stream is the concatenation of its documents' tokens, read
through `TokenStream`: windows may cross document boundaries, and each token's document index is known, so
`data.document_masking` still masks them.

Opening reads no corpus: the per-document arrays come memory-mapped from the source's index cache (source_index),
built once, and each 64 MiB chunk of a .bin is verified the first time this process reads from it
(source_index.ChunkVerifier).

Every source of a blend must be tokenized alike: a blend of directories prepared with different tokenizers would
train on ids that mean different things. A prepared directory's meta.json names its tokenizer and the sha256 of its
file; a Megatron-LM prefix names none, so its ids are checked against the run's vocabulary as they are read.
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...config.schema import BlendEntry, DataConfig, PretrainConfig
from ...tokenizer import KNOWN_BY_NAME, TokenizerIdentity, tokenizer_vocab_size, trains_bpe
from ....checkpointing.tensor_io import file_digest
from .source_index import (ChunkVerifier, chunks_digest, index_streams, megatron_index, open_tokens, prepared_index,
                           verified_record)
from ..previous_format import read_splits
from ..token_files import DataFileError, is_previous_format, meta_and_reason, prepare_again, verify_at_start

__all__ = ["TokenSource", "TokenStream", "blend_entries", "index_cache_root", "open_blend", "open_source",
           "prepared_tokenizer"]


class TokenStream:
    """Segments of a source's token space read as one stream: segment k is the tokens
    [segment_source[k], segment_source[k] + segment_starts[k + 1] - segment_starts[k]) of the source, from its
    document segment_document[k], and starts at segment_starts[k] in the stream (source_index.py)."""

    def __init__(self, shards: list[tuple[np.ndarray, Path]], segments: tuple, vocab: tuple[int, str], name: str,
                 verifiers: list[ChunkVerifier | None] | None = None,
                 coarse: tuple[int, np.ndarray] | None = None) -> None:
        """shards: each shard's tokens and file; segments: (segment_starts, segment_source, segment_document),
        memory-mapped or in memory; vocab: (size, where that size comes from) for the id check; verifiers: each
        shard's chunk verifier (None: its file was verified at start); coarse: (stride, segment_starts[::stride])
        for memory-mapped starts (source_index.py), None to search them whole."""
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
    # (file, sha256) pairs that identify the bytes this process reads: the ranks compare them (run_data.py)
    copies: list[tuple[str, str]] = field(default_factory=list)


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
            verify_at_start(path, meta, TokenizerIdentity.from_meta(meta).data_dir_files())
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
    for i, (tokens, shard) in enumerate(zip(open_tokens(prefixes), info["shards"])):
        shards.append((tokens.tokens, tokens.bin_path))
        verifiers.append(ChunkVerifier(tokens.bin_path, shard["chunk_bytes"], shard["chunk_sha256"],
                                       tokens.dtype.itemsize, fix, directory / verified_record(i))
                         if verify and shard["chunk_sha256"] is not None else None)
    streams = index_streams(directory)
    train, val = (TokenStream(shards, segments, vocab, name, verifiers, (info["coarse"], coarse))
                  for segments, coarse in streams)
    return TokenSource(name, train, val, vocab[0], meta, info["num_documents"], info, _copies(name, meta, info))


def _copies(name: str, meta: dict | None, info: dict | None) -> list[tuple[str, str]]:
    """What identifies a copy of the source: its meta.json (which records every file's hashes), or a Megatron-LM
    prefix's .idx and the hashes of its .bin's chunks (from its index cache)."""
    if meta is not None:
        return [(str(Path(name) / "meta.json"), file_digest(Path(name) / "meta.json")["sha256"])]
    return [(f"{name}.idx", info["idx_sha256"]), (f"{name}.bin", chunks_digest(info))]


def _previous_format(path: str, meta: dict) -> TokenSource:
    """The previous release's train.bin / val.bin (with train.idx / val.idx document offsets when present)."""
    vocab = (int(meta["vocab_size"]), f"the tokenizer {meta['tokenizer']} ({Path(path) / 'meta.json'})")
    streams = [TokenStream.in_memory([(tokens, bin_path)], starts, lengths, np.arange(len(starts)), vocab, path)
               for tokens, bin_path, starts, lengths in read_splits(path, meta)]
    return TokenSource(path, *streams, vocab[0], meta, int(meta.get("num_documents", 0)), None,
                       _copies(path, meta, None))


def blend_entries(data: DataConfig) -> list[BlendEntry]:
    """data.blend, or data.data_dir as a blend of one."""
    return list(data.blend) or [BlendEntry(path=data.data_dir, weight=1.0)]


def prepared_tokenizer(sources: list[TokenSource], spec: str) -> Path | None:
    """The tokenizer.json the prepared sources were made with (for data.tokenizer=bpe, the first prepared
    directory's own), after checking every prepared source against `spec`; None for byte / gpt2 or no meta."""
    prepared = [s for s in sources if s.meta is not None]
    if trains_bpe(spec):  # each directory trained its own: the first one's is the run's
        path = Path(prepared[0].name) / "tokenizer.json" if prepared else None
        wanted = TokenizerIdentity(spec, TokenizerIdentity.from_meta(prepared[0].meta).sha256) if prepared else None
    else:  # as meta.json records it: byte / gpt2 by name, a tokenizer.json by its absolute path and sha256
        wanted = TokenizerIdentity.of_spec(spec)
        path = Path(wanted.name) if wanted.sha256 is not None else None
    for source in prepared:
        have = TokenizerIdentity.from_meta(source.meta)
        if wanted is not None and (have.sha256 != wanted.sha256 or (_by_name(spec) and have.name != spec)):
            raise DataFileError(
                f"{source.name} was prepared with the tokenizer {have.name} (sha256 {have.sha256}, its meta.json) but "
                f"this run's data.tokenizer={spec!r} is {wanted.name} (sha256 {wanted.sha256}): every source of a run "
                "must use one tokenizer; set data.tokenizer to the one the data was prepared with, or prepare the "
                "source again with this one (scripts/prepare_data.py --tokenizer ...).")
    return path


def _by_name(spec: str) -> bool:
    """Whether meta.json records `spec` under its own name (byte, gpt2, bpe), not as a path that differs by machine."""
    return spec in KNOWN_BY_NAME or trains_bpe(spec)


def open_blend(data: DataConfig, index_cache: Path | None, model_vocab_size: int) -> tuple[list[TokenSource],
                                                                                          list[float]]:
    """The blend's sources, each verified against its meta.json and checked against the run's tokenizer and the
    model's vocabulary, and their weights; `index_cache`: the root of the index caches of Megatron-LM prefixes
    (open_source)."""
    paths = [e.path for e in data.blend] or [data.data_dir]  # blend_entries, without building a BlendEntry
    vocab = (tokenizer_vocab_size(data.tokenizer, data.bpe_vocab_size), data.tokenizer)
    sources = [open_source(path, data.val_fraction, vocab, index_cache=index_cache) for path in paths]
    prepared_tokenizer(sources, data.tokenizer)
    for source in sources:
        if source.vocab_size > model_vocab_size:
            tokenizer = source.meta["tokenizer"] if source.meta else data.tokenizer
            raise DataFileError(f"the data in {source.name} was prepared with the tokenizer {tokenizer} of "
                                f"{source.vocab_size} tokens (its meta.json) but model.vocab_size="
                                f"{model_vocab_size}: set model.vocab_size >= {source.vocab_size}, or prepare the "
                                "data with another tokenizer.")
    return sources, [e.weight for e in data.blend] or [1.0]


def index_cache_root(cfg: PretrainConfig) -> Path:
    """data.index_cache, or, when it is null, `.index_cache` beside the run directory (in the directory that holds
    the runs): shared by the runs there, so a new run does not index and hash a Megatron-LM prefix again."""
    if cfg.data.index_cache is not None:
        return Path(cfg.data.index_cache)
    return Path(cfg.logging.run_dir).resolve().parent / ".index_cache"
