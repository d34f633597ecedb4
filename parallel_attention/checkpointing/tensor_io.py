"""The one module that moves tensors and bytes to and from disk: safetensors shards, checksums, durability.

Checkpoints, token files and Hugging Face exports all need the same few guarantees, so they live
here once: a file is written under a temporary name and renamed into place (a crash never leaves a
half-written file under the real name), flushed with fsync before its directory entry is made
durable, and identified by its size and sha256. Safetensors (no pickle) is the only tensor format:
reading a shard runs no code.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

_CHUNK = 1 << 22  # 4 MiB per read while hashing: large shards are never held in memory twice


def file_digest(path: Path, *, fsync: bool = False) -> dict:
    """{"size", "sha256"} of the file at `path` (fsync'd first when `fsync`), as a manifest records it."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
        if fsync:
            os.fsync(f.fileno())
        size = f.tell()
    return {"size": size, "sha256": digest.hexdigest()}


def seal_file(path: Path) -> dict:
    """Flush a freshly written file to disk; return the size and sha256 the manifest records."""
    return file_digest(path, fsync=True)


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, chunks: Iterable[bytes]) -> str:
    """Write byte chunks to a temporary name, fsync, rename over `path`, fsync its directory; return the sha256."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    with open(tmp, "wb") as f:
        for chunk in chunks:
            digest.update(chunk)
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return digest.hexdigest()


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> dict:
    """Save `tensors` (contiguous, one storage each: see `cpu_tensors`) at `path`; return its sealed size and sha256.

    Not atomic on its own: checkpoints write into a temporary directory that is renamed into place.
    """
    save_file(tensors, str(path), metadata=metadata)
    return seal_file(path)


class TensorFileError(ValueError):
    """A safetensors file that cannot be read (truncated, empty, not safetensors, unreadable): the message
    names it and its size. A ValueError, so the scripts report it as one line like any bad input."""


def size_of(path: Path) -> str:
    """`N bytes`, or `no such file`: how an error names a file it could not read."""
    try:
        return f"{path.stat().st_size} bytes"
    except OSError:
        return "no such file"


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of a safetensors file and its string metadata ({} when it has none).

    safetensors' own errors ("header too small", "incomplete metadata") name no file, and a model or
    checkpoint is many files: TensorFileError names this one, its size, and what to do."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise TensorFileError(
            f"{path} ({size_of(Path(path))}) is not a readable safetensors file ({error}): it is truncated "
            "(an interrupted copy, download or save), empty, or not safetensors; copy or download it again "
            "(a checkpoint: load an older one)") from error


def cpu_tensors(tensors: dict) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, each storage saved once: safetensors refuses tied or partly viewed storage."""
    out, seen = {}, set()
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state entry {name!r} is a {type(value).__name__}, not a tensor: "
                            "safetensors checkpoints hold tensors only.")
        t = value.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def retire_directory(path: Path, nonce: str) -> None:
    """Rename `path` out of its name first (atomic: readers see it or not), then delete it at leisure."""
    doomed = path.with_name(f"{path.name}.tmp-delete-{nonce}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def replace_directory(tmp: Path, final: Path, nonce: str) -> None:
    """Make the complete, filled directory `tmp` become `final`, retiring what was there.

    Nothing at `final` is touched before `tmp` is complete and durable; a crash between the two
    renames leaves the old directory under a `.tmp-delete-` name and the new one under `tmp`."""
    fsync_dir(tmp)
    if final.exists():
        retire_directory(final, nonce)
    os.rename(tmp, final)
    fsync_dir(final.parent)
