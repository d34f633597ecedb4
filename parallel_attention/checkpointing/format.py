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

Format versions: 2 holds each rank's fused QKV rows as [q heads | k heads | v heads]; 1 (0.1.0 and
later, until the reorder) held them per query group, [q heads | k | v] per k/v head. Version 1 is still
read: `compatibility.upgrade_shard` reorders its fused rows (and their optimizer moments) as they are read, and
`read_manifest` returns the config of a manifest written by an older release under today's keys
(`compatibility.upgrade_manifest`).

A checkpoint is complete iff its directory is named exactly `step_<digits>` and holds manifest.json.
Writers fill `step_0000100.tmp-<nonce>/` and rename it into place only after the manifest is durable,
so a crash leaves at most a `.tmp-` directory, which is never listed or loaded.

Assumption: every rank sees the same filesystem (one node, or several nodes on shared storage with
close-to-open consistency, e.g. NFS or Lustre), rename is atomic on it, and a checkpoint root belongs
to one run at a time (the run directory's lock; a dead run's `.tmp-` directories are deleted at the next start).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from .compatibility import upgrade_manifest, upgrade_shard
from .errors import CheckpointCorruptError, CheckpointError
from .tensor_io import file_digest, fsync_dir, read_safetensors, replace_directory, retire_directory, write_atomic

FORMAT = "parallel_attention.checkpoint"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
_COMPLETE = re.compile(r"step_(\d+)")
_TEMPORARY = re.compile(r"step_\d+\.tmp-.*")


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def shard_name(tp_rank: int, stage: int | None = None) -> str:
    """"tp01", or "tp01_pp02" for pipeline stage 2 of a checkpoint written at pipeline_parallel_size > 1."""
    return f"tp{tp_rank:02d}" + (f"_pp{stage:02d}" if stage is not None else "")


def model_file(tp_rank: int, stage: int | None = None) -> str:
    return f"model_{shard_name(tp_rank, stage)}.safetensors"


def optim_file(tp_rank: int, stage: int | None = None) -> str:
    return f"optim_{shard_name(tp_rank, stage)}.safetensors"


def pipeline_stages(manifest: dict) -> list[int | None]:
    """The pipeline stages whose shards a checkpoint holds: [None] (file names without a stage) at pp = 1."""
    pp = manifest.get("pipeline_parallel_size", 1)
    return [None] if pp == 1 else list(range(pp))


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


def list_incomplete(ckpt_root: str | os.PathLike) -> list[Path]:
    """`step_N` directories without a manifest (emptied or never finished by another writer): never loaded."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    return sorted(e for e in root.iterdir() if _COMPLETE.fullmatch(e.name) and not (e / MANIFEST).is_file())


def list_temporaries(ckpt_root: str | os.PathLike) -> list[Path]:
    """`step_N.tmp-*` directories: a save in progress, or one a killed run left behind."""
    root = Path(ckpt_root)
    return sorted(e for e in root.iterdir() if _TEMPORARY.fullmatch(e.name)) if root.is_dir() else []


def latest_checkpoint(ckpt_root: str | os.PathLike) -> Path | None:
    complete = list_checkpoints(ckpt_root)
    return complete[-1] if complete else None


def write_manifest(directory: Path, manifest: dict) -> None:
    """Write manifest.json atomically (a temporary file, fsync, rename, fsync of the directory)."""
    text = json.dumps(manifest, indent=1, sort_keys=True)
    write_atomic(directory / MANIFEST, [text.encode("utf-8")])


def read_manifest(directory: str | os.PathLike, *, config_sections: tuple[str, ...] = (), verify: bool = True) -> dict:
    """The manifest of a complete checkpoint, cross-checked against its directory: the one reader of manifest.json.

    CheckpointCorruptError (an older checkpoint may still be good) names what is wrong when the file
    is missing or unreadable, a required key is missing or of the wrong type, `step` is not the
    directory's step, the layout does not add up, a model shard or a `model_shapes` entry is missing
    for some tensor-parallel rank, or `config` lacks one of `config_sections` (the sections the
    caller reads, e.g. ("model", "parallel") for a training run). verify=False: only read (a JSON object,
    else CheckpointCorruptError) and upgraded, for a look at one record (the data's identity, the config)
    ahead of the load that verifies the checkpoint, or where a missing record is not an error.
    """
    path = Path(directory) / MANIFEST
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path} is missing: {directory} is not a complete checkpoint.") from None
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{path} is unreadable ({e}).") from e
    if not verify and isinstance(manifest, dict):
        return upgrade_manifest(manifest)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{path} is not a {FORMAT} manifest.")
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path} has format_version={manifest.get('format_version')!r}; this loader reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))}: load it with a newer parallel_attention.")
    problems = _manifest_problems(manifest, Path(directory), config_sections)
    if problems:
        raise CheckpointCorruptError(f"{path} does not describe its checkpoint: " + "; ".join(problems) + ".")
    return upgrade_manifest(manifest)


# required keys and their JSON types ("model_shapes" is checked where written: imports have none)
_MANIFEST_KEYS = {"format": str, "format_version": int, "step": int, "world_size": int, "tensor_parallel_size": int,
                  "data_parallel_size": int, "config": dict, "extra": dict, "files": dict}


def _is(value, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _manifest_problems(m: dict, directory: Path, config_sections: tuple[str, ...]) -> list[str]:
    """What is wrong with a manifest of the current format (empty when nothing is)."""
    problems = [f"{key} is missing" if key not in m else f"{key} is {m[key]!r}, not a JSON {kind.__name__}"
                for key, kind in _MANIFEST_KEYS.items() if not _is(m.get(key), kind)]
    if problems:
        return problems
    named = _COMPLETE.fullmatch(directory.name)
    if named and int(named.group(1)) != m["step"]:
        problems.append(f"step is {m['step']} but the directory is {directory.name}")
    p, dp, world = m["tensor_parallel_size"], m["data_parallel_size"], m["world_size"]
    pp = m.get("pipeline_parallel_size", 1)
    if not _is(pp, int) or min(p, dp, pp) < 1 or p * dp * pp != world:
        stages = f" x pipeline_parallel_size={pp}" if pp != 1 else ""
        problems.append(f"tensor_parallel_size={p} x data_parallel_size={dp}{stages} != world_size={world}")
        return problems
    problems += [f"config has no {s!r} section" for s in config_sections if not isinstance(m["config"].get(s), dict)]
    problems += [f"files[{name!r}] is {record!r}, not {{size, sha256}}" for name, record in m["files"].items()
                 if not (isinstance(record, dict) and _is(record.get("size"), int)
                         and isinstance(record.get("sha256"), str))]
    stages = pipeline_stages(m)
    problems += [f"{model_file(r, s)} of tensor-parallel rank {r} is not in files" for r in range(p) for s in stages
                 if model_file(r, s) not in m["files"]]
    if "model_shapes" in m:
        shards = m["model_shapes"] if isinstance(m["model_shapes"], dict) else {}
        if sorted(shards) != sorted(shard_name(r, s) for r in range(p) for s in stages):
            problems.append(f"model_shapes has shards {sorted(shards)} for tensor_parallel_size={p}"
                            + (f", pipeline_parallel_size={pp}" if pp > 1 else ""))
    return problems


def check_shard_shapes(manifest: dict, tp_rank: int, tensors: dict, stage: int | None = None) -> None:
    """CheckpointCorruptError unless the tensors read from model shard `tp_rank` (of pipeline `stage`) are those
    `model_shapes` lists."""
    listed = manifest.get("model_shapes", {}).get(shard_name(tp_rank, stage))
    if listed is None:  # written without shapes (an import): nothing to compare
        return
    found = {n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for n, t in tensors.items()}
    differ = [f"{n!r}: file {found.get(n, '<absent>')}, manifest {listed.get(n, '<absent>')}"
              for n in sorted(set(found) | set(listed)) if found.get(n) != listed.get(n)]
    if differ:
        raise CheckpointCorruptError(f"{model_file(tp_rank, stage)} disagrees with the manifest's model_shapes: "
                                     + "; ".join(differ[:5]) + (" ..." if len(differ) > 5 else "") + ".")


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


def read_shard(directory: Path, manifest: dict, name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """A model or optimizer file of the checkpoint, verified against the manifest, in today's row order
    (`upgrade_shard`), and its metadata: the one way such a file is read, so no reader can skip a step."""
    tensors, meta = read_safetensors(verify_file(directory, manifest, name))
    return upgrade_shard(manifest, tensors), meta


def commit(tmp: Path, final: Path, nonce: str) -> None:
    """Make the filled temporary directory the checkpoint `final` (replacing one of the same step)."""
    replace_directory(tmp, final, nonce)


def is_finite(directory: Path) -> bool:
    """Whether the run recorded finite values at this checkpoint's step (manifest `extra.finite`, default true).

    A checkpoint whose manifest cannot be read counts as not finite: it cannot be resumed from."""
    try:
        return read_manifest(directory).get("extra", {}).get("finite", True) is not False
    except CheckpointError:
        return False


def prune(root: Path, keep_last: int | None, just_written: Path, nonce: str) -> None:
    """Delete complete checkpoints beyond the newest `keep_last`, and this save's own temporaries.

    Never deleted: `just_written`, and the newest finite checkpoint (`is_finite`), even beyond
    `keep_last`, so that checkpoints saved after a run went non-finite never replace the last good one;
    nor a temporary of another save (`nonce`): it may be another writer's directory about to be renamed into
    place. A dead run's temporaries are removed by the next run that holds the run directory's lock.
    """
    if keep_last is not None:
        older = [p for p in list_checkpoints(root) if p != just_written]
        doomed = older[:max(len(older) - (keep_last - 1), 0)]
        kept = [just_written, *older[len(doomed):]]
        if not any(is_finite(p) for p in kept):
            newest_finite = next((p for p in reversed(doomed) if is_finite(p)), None)
            doomed = [p for p in doomed if p != newest_finite]
        for path in doomed:
            retire_directory(path, nonce)
    for entry in list_temporaries(root):
        if entry.is_dir() and entry.name.endswith(nonce):
            shutil.rmtree(entry, ignore_errors=True)
    fsync_dir(root)
