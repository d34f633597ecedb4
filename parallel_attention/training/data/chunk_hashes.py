"""Token files verified piece by piece as they are read, never whole at start.

Hashing a 2 TB corpus before the first step takes over half an hour. So each `.bin` has a sha256 per chunk of
CHUNK_BYTES (64 MiB; the last chunk is shorter): preparation records them in meta.json (`bin_chunk_sha256`,
`chunk_bytes`), and a Megatron-LM prefix's are computed once when its index cache is built. A `ChunkVerifier`
hashes a chunk the first time this process reads from it and remembers it; a chunk whose hash differs stops the run
with a DataFileError that names the file, the chunk and its bytes. Every byte a run reads is so verified once per
process; the bytes it never reads are never read.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from .token_files import DataFileError

__all__ = ["CHUNK_BYTES", "ChunkVerifier", "chunk_sha256", "file_and_chunk_sha256"]

CHUNK_BYTES = 64 << 20
_READ = 1 << 20


def _hash_range(f, start: int, count: int) -> str:
    digest = hashlib.sha256()
    f.seek(start)
    while count > 0:
        piece = f.read(min(_READ, count))
        if not piece:
            break
        digest.update(piece)
        count -= len(piece)
    return digest.hexdigest()


def chunk_sha256(path: Path, chunk_bytes: int = CHUNK_BYTES, progress=None) -> list[str]:
    """The sha256 of each `chunk_bytes` piece of `path`, in order (none for an empty file); `progress(text)` is
    called after each chunk."""
    return file_and_chunk_sha256(path, chunk_bytes, progress)[1]


def file_and_chunk_sha256(path: Path, chunk_bytes: int = CHUNK_BYTES, progress=None) -> tuple[str, list[str]]:
    """(sha256 of the whole file, sha256 of each chunk), from one pass over it."""
    whole, chunks = hashlib.sha256(), []
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        for start in range(0, size, chunk_bytes):
            digest = hashlib.sha256()
            for piece in iter(lambda: f.read(min(_READ, start + chunk_bytes - f.tell())), b""):
                digest.update(piece)
                whole.update(piece)
            chunks.append(digest.hexdigest())
            if progress is not None:
                progress(f"{path}: {len(chunks)} of {-(-size // chunk_bytes)} chunks hashed")
    return whole.hexdigest(), chunks


class ChunkVerifier:
    """The chunks of one token file this process has verified, and the check of those it has not."""

    def __init__(self, path: Path, chunk_bytes: int, hashes: list[str], itemsize: int,
                 fix: str | Callable[[], str]) -> None:
        """`fix`: what the refusal tells the user to do (prepare again, or which cache to delete), or the function
        that says it, called only when a chunk is refused."""
        self.path, self.chunk_bytes, self.hashes, self.itemsize, self.fix = Path(path), chunk_bytes, hashes, itemsize, fix
        self.verified: set[int] = set()
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

    def _check(self, f, chunk: int) -> None:
        start = chunk * self.chunk_bytes
        if chunk >= len(self.hashes):
            raise DataFileError(f"{self.path} is read at byte {start}, past the {len(self.hashes)} chunks whose "
                                f"hashes were recorded: the file grew after it was hashed; {self._fix()}.")
        actual = _hash_range(f, start, self.chunk_bytes)
        if actual != self.hashes[chunk]:
            error = DataFileError(f"{self.path} has sha256 {actual} in its chunk {chunk} of {self.chunk_bytes} bytes "
                                  f"(from byte {start}), but {self.hashes[chunk]} was recorded: the file changed after "
                                  f"it was prepared or indexed (a bad copy, a disk fault, another write); {self._fix()}.")
            if os.environ.get("RANK", "0") != "0":  # the run reports rank 0's errors: say this one where it arose
                print(f"rank {os.environ['RANK']}: {error}", file=sys.stderr, flush=True)
            raise error
        self.verified.add(chunk)

    def _fix(self) -> str:
        return self.fix() if callable(self.fix) else self.fix
