"""The index cache of one source: its streams' arrays (document_index) and its token files' chunk hashes.

Where: beside a prepared directory (`DIR/.index_cache/`, when the directory is writable) or, for a Megatron-LM
prefix (whose directory this project never writes into) and a read-only prepared directory, under
`data.index_cache` (default RUN/index_cache). Keyed by everything the content depends on: the identity of each
.idx and .bin (size, mtime, ctime, inode: rewriting or replacing a file changes it), a prepared directory's
meta.json (its sha256), data.val_fraction, and this layout's version. A changed key builds a new cache beside the
old; deleting a cache directory (or the whole cache root) at any time between runs only costs a rebuild.

Built once (under index_cache.claim's lock), it checks what a start used to check every time: each .idx is read whole,
checked against its .bin and, for a prepared directory, against the sha256 meta.json records; a Megatron-LM
prefix's .bin is hashed once per 64 MiB chunk (chunk_hashes), which a resume then compares (data_identity.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Generator
from pathlib import Path

import numpy as np

from ....checkpointing.tensor_io import file_digest
from ..chunk_hashes import CHUNK_BYTES, chunk_sha256
from .document_index import SPLITS, load_stream, write_streams
from .index_cache import claim
from ..indexed_dataset import IndexedTokens
from ..token_files import DataFileError, prepare_again, sha256_of

__all__ = ["CACHE_DIR", "VERSION", "chunks_digest", "index_streams", "megatron_index", "prepared_index"]

CACHE_DIR = ".index_cache"
VERSION = 2  # of the cache layout: 2 added the coarse index


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

    def build(tmp: Path, progress) -> Generator[str, None, dict]:
        shards = []
        for shard, prefix in zip(meta["shards"], prefixes):
            idx = Path(f"{prefix}.idx")
            if (actual := sha256_of(idx)) != shard["idx_sha256"]:
                raise DataFileError(f"{idx} has sha256 {actual} but {path / 'meta.json'} records "
                                    f"{shard['idx_sha256']}: the file changed after it was prepared (a bad copy, a "
                                    f"disk fault, another write); {prepare_again(path, meta)}.")
            shards.append(IndexedTokens(prefix))
        info = yield from write_streams(tmp, shards, val_fraction, str(path))
        return {**info, "shards": [_shard_info(s, shard.get("bin_chunk_sha256"), shard.get("chunk_bytes"))
                                   for s, shard in zip(shards, meta["shards"])]}

    root = path / CACHE_DIR if os.access(path, os.W_OK) else fallback_root
    return _found_or_built(root, "prepared" if root != fallback_root else path.name, key, build,
                           f"the index of {path}")


def megatron_index(prefix: Path, val_fraction: float, root: Path) -> tuple[Path, dict]:
    """(cache directory, info) of a Megatron-LM prefix: its .bin hashed per chunk once, here."""
    key = {"version": VERSION, "kind": "megatron", "path": str(prefix.resolve()), "val_fraction": val_fraction,
           "chunk_bytes": CHUNK_BYTES, "files": _prefix_files(prefix)}

    def build(tmp: Path, progress) -> Generator[str, None, dict]:
        shard = IndexedTokens(prefix)
        info = yield from write_streams(tmp, [shard], val_fraction, str(prefix))
        hashes = chunk_sha256(shard.bin_path, CHUNK_BYTES, progress)
        return {**info, "idx_sha256": file_digest(shard.idx_path)["sha256"], "shards": [_shard_info(shard, hashes, CHUNK_BYTES)]}

    return _found_or_built(root, prefix.name, key, build, f"the index of {prefix}")


def _found_or_built(root: Path, name: str, key: dict, build, what: str) -> tuple[Path, dict]:
    """(directory, info) of a cache: found, waited for, or built here and stored. `build(tmp, progress)` is a
    generator that yields how far it is (reported here, which keeps the lock fresh) and returns the info."""
    directory, info, claimed = claim(root, name, key, what)
    if claimed is not None:
        with claimed:
            steps = build(claimed.tmp, claimed.progress)
            while True:
                try:
                    claimed.progress(next(steps))
                except StopIteration as built:
                    info = claimed.store(built.value)
                    break
    return directory, info


def _shard_info(shard: IndexedTokens, hashes: list[str] | None, chunk_bytes: int | None) -> dict:
    return {"prefix": str(shard.prefix), "num_tokens": shard.num_tokens, "chunk_bytes": chunk_bytes,
            "chunk_sha256": hashes}


def chunks_digest(info: dict) -> str:
    """One sha256 over every chunk hash of a cache's shards: what a checkpoint records of a Megatron .bin."""
    listing = [(s["chunk_bytes"], s["chunk_sha256"]) for s in info["shards"]]
    return hashlib.sha256(json.dumps(listing).encode("utf-8")).hexdigest()


def index_streams(directory: Path) -> list[tuple[tuple[np.ndarray, ...], np.ndarray]]:
    """The training and validation streams' arrays of the index cache `directory`, memory-mapped
    (document_index.load_stream), in the order of document_index.SPLITS."""
    return [load_stream(directory, split) for split in SPLITS]
