"""The index of one source: its training and validation streams as arrays on disk, and its token files' chunk
hashes, built once into its index cache.

Where: beside a prepared directory (`DIR/.index_cache/`, when the directory is writable) or, for a Megatron-LM
prefix (whose directory this project never writes into) and a read-only prepared directory, under
`data.index_cache` (default RUN/index_cache). Keyed by everything the content depends on: the identity of each
.idx and .bin (size, mtime, ctime, inode: rewriting or replacing a file changes it), a prepared directory's
meta.json (its sha256), data.val_fraction, and this layout's version. A changed key builds a new cache beside the
old; deleting a cache directory (or the whole cache root) at any time between runs only costs a rebuild.

Built once (under index_cache.claim's lock), it checks what a start used to check every time: each .idx is read
whole, checked against its .bin and, for a prepared directory, against the sha256 meta.json records; a Megatron-LM
prefix's .bin is hashed once per 64 MiB chunk (chunk_hashes), which a resume then compares (data_identity.py),
and every chunk is verified the first time a process reads from it (`ChunkVerifier`).

The streams' arrays are written in pieces and memory-mapped when read. A stream (token_source.TokenStream) is a list
of segments, one per document: segment k is the document `document[k]`, whose tokens start at `source[k]` in the
source's token space, and it starts at `starts[k]` in the stream (`starts[-1]` is the stream's length). These are 24
bytes a document: 24 GB at 10^9 documents, too much for every rank to hold. So they are written once, document piece
by document piece (memory O(1) in the corpus), as `.npy` files (`train_starts.npy`, `train_source.npy`,
`train_document.npy`, and `val_*`), which every rank opens with np.load(mmap_mode="r"): a step's read touches only
the pages its windows need (a binary search in `starts`), and a rank's memory no longer grows with the corpus.

Beside them, `train_coarse.npy` holds every COARSE-th entry of `starts` (a few MB at 10^9 documents), read
into memory: a window's segment is found in it first, then in one COARSE-entry slice of `starts`, so a lookup
reads a page or two of the map instead of the ~30 scattered ones of a binary search over all of it (each a read
on a network filesystem).

The values are those the previous in-memory build held, so batches are unchanged: every ~1/val_fraction-th
document is validation (document_split); a source of a single document gives its last val_fraction of tokens to
validation.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Callable

import numpy as np

from ....checkpointing.tensor_io import file_digest
from ..chunk_hashes import CHUNK_BYTES, hash_chunks, hash_range
from ..document_split import validation_range
from .index_cache import CacheWriteError, claim, drop_superseded, found, read_verified, remember_verified
from ..indexed_dataset import IndexedTokens
from ..token_files import DataFileError, prepare_again

__all__ = ["CACHE_DIR", "COARSE", "SPLITS", "VERSION", "ChunkVerifier", "chunks_digest", "index_streams",
           "megatron_index", "open_tokens", "prepared_index", "verified_record", "write_streams"]

CACHE_DIR = ".index_cache"
VERSION = 2  # of the cache layout: 2 added the coarse index
SPLITS = ("train", "val")
COARSE = 4096  # entries of `starts` per entry of the in-memory coarse index
_FIELDS = ("starts", "source", "document")


def _file_key(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


def _prefix_files(prefix: Path) -> dict:
    return {f"{prefix.name}.{kind}": _file_key(Path(f"{prefix}.{kind}")) for kind in ("idx", "bin")}


def prepared_index(path: Path, meta: dict, val_fraction: float, fallback_root: Path) -> tuple[Path, dict]:
    """(cache directory, info) of a prepared directory of format 2."""
    prefixes = [path / shard["prefix"] for shard in meta["shards"]]
    files = {}
    for prefix in prefixes:
        files.update(_prefix_files(prefix))
    key = {"version": VERSION, "kind": "prepared", "path": str(path.resolve()), "val_fraction": val_fraction,
           "meta_sha256": hashlib.sha256((path / "meta.json").read_bytes()).hexdigest(), "files": files}

    def build(tmp: Path) -> Generator[str, None, dict]:
        shards = []
        for shard, prefix in zip(meta["shards"], prefixes):
            idx = Path(f"{prefix}.idx")
            if (actual := file_digest(idx)["sha256"]) != shard["idx_sha256"]:
                raise DataFileError(f"{idx} has sha256 {actual} but {path / 'meta.json'} records "
                                    f"{shard['idx_sha256']}: the file changed after it was prepared (a bad copy, a "
                                    f"disk fault, another write); {prepare_again(path, meta)}.")
            shards.append(IndexedTokens(prefix))
        info = yield from write_streams(tmp, shards, val_fraction, str(path))
        return {**info, "shards": [_shard_info(s, shard.get("bin_chunk_sha256"), shard.get("chunk_bytes"))
                                   for s, shard in zip(shards, meta["shards"])]}

    what, primary = f"the index of {path}", path / CACHE_DIR
    if _in_primary(path, key, fallback_root):
        try:
            return _found_or_built(primary, "prepared", key, build, what)
        except CacheWriteError as error:  # no space left or no permission there: every process gets here alike
            print(f"{error}; building it under data.index_cache ({fallback_root}) instead", file=sys.stderr,
                  flush=True)
    return _found_or_built(fallback_root, path.name, key, build, what)


def _in_primary(path: Path, key: dict, fallback_root: Path) -> bool:
    """Whether a prepared directory's index goes in DIR/.index_cache: it holds it, or, unless data.index_cache does
    (an earlier build fell back), it can be written (it, or DIR where it does not exist yet). A read-only directory
    or cache is read, never refused for it."""
    primary = path / CACHE_DIR
    if found(primary, "prepared", key) is not None:
        return True
    if found(fallback_root, path.name, key) is not None:
        return False
    return os.access(primary, os.W_OK | os.X_OK) if primary.is_dir() else os.access(path, os.W_OK | os.X_OK)


def megatron_index(prefix: Path, val_fraction: float, root: Path) -> tuple[Path, dict]:
    """(cache directory, info) of a Megatron-LM prefix: its .bin hashed per chunk once, here."""
    key = {"version": VERSION, "kind": "megatron", "path": str(prefix.resolve()), "val_fraction": val_fraction,
           "chunk_bytes": CHUNK_BYTES, "files": _prefix_files(prefix)}

    def build(tmp: Path) -> Generator[str, None, dict]:
        shard = IndexedTokens(prefix)
        info = yield from write_streams(tmp, [shard], val_fraction, str(prefix))
        _, hashes = yield from hash_chunks(shard.bin_path, CHUNK_BYTES)
        return {**info, "idx_sha256": file_digest(shard.idx_path)["sha256"],
                "shards": [_shard_info(shard, hashes, CHUNK_BYTES)]}

    return _found_or_built(root, prefix.name, key, build, f"the index of {prefix}")


def _found_or_built(root: Path, name: str, key: dict, build, what: str) -> tuple[Path, dict]:
    """(directory, info) of a cache: found, waited for, or built here and stored. `build(tmp)` is a
    generator that yields how far it is (reported here, which keeps the lock fresh) and returns the info."""
    directory, info, claimed = claim(root, name, key, what)
    if claimed is not None:
        with claimed:
            steps = build(claimed.tmp)
            while True:
                try:
                    claimed.progress(next(steps))
                except StopIteration as built:
                    info = claimed.store(built.value)
                    break
        drop_superseded(directory, key, ("kind", "path", "val_fraction"))
    return directory, info


def _shard_info(shard: IndexedTokens, hashes: list[str] | None, chunk_bytes: int | None) -> dict:
    return {"prefix": str(shard.prefix), "num_tokens": shard.num_tokens, "chunk_bytes": chunk_bytes,
            "chunk_sha256": hashes}


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


def chunks_digest(info: dict) -> str:
    """One sha256 over every chunk hash of a cache's shards: what a checkpoint records of a Megatron .bin."""
    listing = [(s["chunk_bytes"], s["chunk_sha256"]) for s in info["shards"]]
    return hashlib.sha256(json.dumps(listing).encode("utf-8")).hexdigest()


def index_streams(directory: Path) -> list[tuple[tuple[np.ndarray, ...], np.ndarray]]:
    """The training and validation streams' arrays of the index cache `directory`, memory-mapped, in the order of
    SPLITS."""
    return [_load_stream(directory, split) for split in SPLITS]


def _load_stream(directory: Path, split: str) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """((starts, source, document) of `split`, memory-mapped read-only; its coarse index, in memory)."""
    return (tuple(np.load(directory / f"{split}_{field}.npy", mmap_mode="r") for field in _FIELDS),
            np.load(directory / f"{split}_coarse.npy"))


def open_tokens(prefixes: list[Path]) -> list[IndexedTokens]:
    """Each shard's tokens, memory-mapped, for reading once its index cache is there (which checked each .idx)."""
    return [IndexedTokens(prefix, check_index=False) for prefix in prefixes]


class ChunkVerifier:
    """The chunks of one token file verified so far, and the check of those that are not.

    With `remembered` (a file in the source's index cache, whose key changes with the token file's size, times and
    inode), the chunks verified by earlier starts are trusted as the cache is: a restart does not hash them again.
    As with the sha256 cache of whole files, what this cannot see is corruption beneath the filesystem; delete the
    index cache to verify every chunk again."""

    def __init__(self, path: Path, chunk_bytes: int, hashes: list[str], itemsize: int,
                 fix: str | Callable[[], str], remembered: Path | None = None) -> None:
        """`fix`: what the refusal tells the user to do (prepare again, or which cache to delete), or the function
        that says it, called only when a chunk is refused."""
        self.path, self.chunk_bytes, self.hashes, self.itemsize = Path(path), chunk_bytes, hashes, itemsize
        self.fix, self.remembered = fix, remembered
        self.verified: set[int] = read_verified(remembered, len(hashes))
        self._lock = threading.Lock()  # the prefetch thread and the main thread may read at once

    def check_tokens(self, positions: np.ndarray) -> None:
        """Verify every chunk that holds one of the token `positions` (indices into the file), once."""
        if len(self.verified) == len(self.hashes) or positions.size == 0:
            return
        chunks = np.unique(np.asarray(positions, dtype=np.int64) * self.itemsize // self.chunk_bytes)
        todo = [int(c) for c in chunks if int(c) not in self.verified]
        if todo:
            with self._lock, open(self.path, "rb") as f:
                for chunk in todo:
                    if chunk not in self.verified:
                        self._check(f, chunk)
                remember_verified(self.remembered, self.verified)

    def _check(self, f, chunk: int) -> None:
        start = chunk * self.chunk_bytes
        if chunk >= len(self.hashes):
            raise DataFileError(f"{self.path} is read at byte {start}, past the {len(self.hashes)} chunks whose "
                                f"hashes were recorded: the file grew after it was hashed; {self._fix()}.")
        actual = hash_range(f, start, self.chunk_bytes)
        if actual != self.hashes[chunk]:
            error = DataFileError(f"{self.path} has sha256 {actual} in its chunk {chunk} of {self.chunk_bytes} bytes "
                                  f"(from byte {start}), but {self.hashes[chunk]} was recorded: the file changed after "
                                  f"it was prepared or indexed (a bad copy, a disk fault, another write); "
                                  f"{self._fix()}.")
            if os.environ.get("RANK", "0") != "0":  # the run reports rank 0's errors: say this one where it arose
                print(f"rank {os.environ['RANK']}: {error}", file=sys.stderr, flush=True)
            raise error
        self.verified.add(chunk)

    def _fix(self) -> str:
        return self.fix() if callable(self.fix) else self.fix


def verified_record(shard: int) -> str:
    """The file of an index cache that records which chunks of its `shard`-th .bin have been verified."""
    return f"verified_chunks_{shard:05d}.json"
