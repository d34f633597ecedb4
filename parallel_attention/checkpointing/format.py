"""The checkpoint format on disk: file names, the manifest, discovery, commit and retention.

What a checkpoint directory holds and when it counts as complete is decided here, and only here;
how tensors are encoded is `state_encoding`, how bytes reach the disk is `tensor_io`, and the
collective protocol that fills a directory is `checkpoint`.

    <root>/step_0000100/
        model_tp00.safetensors     TP rank 0's module state_dict, keys as they are (written by its DP rank 0)
        optim_tp00.safetensors     `<state key>/<param name>` (exp_avg/up.weight, step/up.weight, ...);
                                   metadata: param_groups (hyper-parameters + param names), scalar_state, JSON
        rng_rank00000.safetensors  global rank 0's generators: torch/cpu, torch/cuda, tensor_parallel/<device>,
                                   numpy/keys as uint8 tensors; Python's and NumPy's rest as JSON metadata
        manifest.json              written last, by global rank 0: layout, config, extra, shapes, and the
                                   size and sha256 of every file

A checkpoint is complete iff its directory is named exactly `step_<digits>` and holds manifest.json.
Writers fill `step_0000100.tmp-<nonce>/` and rename it into place only after the manifest is durable,
so a crash leaves at most a `.tmp-` directory, which is never listed or loaded.

Assumption: every rank sees the same filesystem (one node, or several nodes on shared storage with
close-to-open consistency, e.g. NFS or Lustre), rename is atomic on it, and a checkpoint root belongs
to one run at a time (stale `.tmp-` directories in it are deleted after each successful save).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from .tensor_io import file_digest, fsync_dir, write_atomic

FORMAT = "parallel_attention.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_COMPLETE = re.compile(r"step_(\d+)")
_TEMPORARY = re.compile(r"step_\d+\.tmp-.*")


class CheckpointError(ValueError):
    """This checkpoint cannot be used by this run; the message says what differs."""


class CheckpointCorruptError(CheckpointError):
    """Files are missing, truncated or altered: an older checkpoint may still be good."""


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def model_file(tp_rank: int) -> str:
    return f"model_tp{tp_rank:02d}.safetensors"


def optim_file(tp_rank: int) -> str:
    return f"optim_tp{tp_rank:02d}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.safetensors"


def list_checkpoints(ckpt_root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under `ckpt_root`, oldest step first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _COMPLETE.fullmatch(entry.name)
        if match and (entry / MANIFEST).is_file():
            found.append((int(match.group(1)), entry))
    return [path for _, path in sorted(found)]


def latest_checkpoint(ckpt_root: str | os.PathLike) -> Path | None:
    complete = list_checkpoints(ckpt_root)
    return complete[-1] if complete else None


def write_manifest(directory: Path, manifest: dict) -> None:
    """Write manifest.json atomically (a temporary file, fsync, rename, fsync of the directory)."""
    text = json.dumps(manifest, indent=1, sort_keys=True)
    write_atomic(directory / MANIFEST, [text.encode("utf-8")])


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a complete checkpoint; CheckpointCorruptError if it is missing or unreadable."""
    path = Path(directory) / MANIFEST
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path} is missing: {directory} is not a complete checkpoint.") from None
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{path} is unreadable ({e}).") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{path} is not a {FORMAT} manifest.")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format_version={manifest.get('format_version')!r}; this loader reads {FORMAT_VERSION}.")
    return manifest


def verify_file(directory: Path, manifest: dict, name: str) -> Path:
    """Check `name` against the size and sha256 in the manifest before anything reads it."""
    path = directory / name
    expected = manifest.get("files", {}).get(name)
    if expected is None:
        raise CheckpointCorruptError(f"{name} is not listed in {directory / MANIFEST}.")
    if not path.is_file():
        raise CheckpointCorruptError(f"{name} is listed in the manifest but missing from {directory}.")
    size = path.stat().st_size
    if size != expected["size"]:
        raise CheckpointCorruptError(
            f"{name}: size {size} bytes, manifest expects {expected['size']} (truncated or overwritten?).")
    actual = file_digest(path)["sha256"]
    if actual != expected["sha256"]:
        raise CheckpointCorruptError(f"{name}: sha256 {actual}, manifest expects {expected['sha256']} (corrupted).")
    return path


def _retire(path: Path, nonce: str) -> None:
    """Rename out of the complete namespace first (atomic), then delete at leisure."""
    doomed = path.with_name(f"{path.name}.tmp-delete-{nonce}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def commit(tmp: Path, final: Path, nonce: str) -> None:
    """Make the filled temporary directory the checkpoint `final` (replacing one of the same step)."""
    fsync_dir(tmp)
    if final.exists():
        _retire(final, nonce)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def prune(root: Path, keep_last: int | None, just_written: Path, nonce: str) -> None:
    """Delete complete checkpoints beyond the newest `keep_last` (never `just_written`) and stale temporaries."""
    if keep_last is not None:
        older = [p for p in list_checkpoints(root) if p != just_written]
        for path in older[:max(len(older) - (keep_last - 1), 0)]:
            _retire(path, nonce)
    for entry in root.iterdir():
        if entry.is_dir() and _TEMPORARY.fullmatch(entry.name):
            shutil.rmtree(entry, ignore_errors=True)
    fsync_dir(root)
