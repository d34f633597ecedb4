"""Token files hashed piece by piece, so that they can be verified as they are read, never whole at start.

Hashing a 2 TB corpus before the first step takes over half an hour. So each `.bin` has a sha256 per chunk of
CHUNK_BYTES (64 MiB; the last chunk is shorter): preparation records them in meta.json (`bin_chunk_sha256`,
`chunk_bytes`), and a Megatron-LM prefix's are computed once when its index cache is built. The reader verifies a
chunk the first time it reads from it (source_index.ChunkVerifier): every byte a run reads is so verified once per
process; the bytes it never reads are never read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Generator
from pathlib import Path

__all__ = ["CHUNK_BYTES", "file_and_chunk_sha256", "hash_chunks", "hash_range"]

CHUNK_BYTES = 64 << 20
_READ = 1 << 20


def hash_range(f, start: int, count: int) -> str:
    """The sha256 of `count` bytes of the open file `f` from byte `start` (fewer at its end)."""
    digest = hashlib.sha256()
    f.seek(start)
    while count > 0:
        piece = f.read(min(_READ, count))
        if not piece:
            break
        digest.update(piece)
        count -= len(piece)
    return digest.hexdigest()


def hash_chunks(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Generator[str, None, tuple[str, list[str]]]:
    """(sha256 of the whole file, sha256 of each `chunk_bytes` piece of it, none for an empty file), from one pass
    over it, yielding how far it is after each chunk (`result = yield from ...`): nothing here calls back."""
    whole, chunks = hashlib.sha256(), []
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        for start in range(0, size, chunk_bytes):
            digest = hashlib.sha256()
            for piece in iter(lambda: f.read(min(_READ, start + chunk_bytes - f.tell())), b""):
                digest.update(piece)
                whole.update(piece)
            chunks.append(digest.hexdigest())
            yield f"{path}: {len(chunks)} of {-(-size // chunk_bytes)} chunks hashed"
    return whole.hexdigest(), chunks


def file_and_chunk_sha256(path: Path, chunk_bytes: int = CHUNK_BYTES) -> tuple[str, list[str]]:
    """hash_chunks(path, chunk_bytes), run to its end."""
    steps = hash_chunks(path, chunk_bytes)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
