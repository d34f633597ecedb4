"""The checkpoint format: names, the tensor encoding of optimizer and RNG state, durable writes,
checksums, the manifest, discovery and retention. (The collective protocol is in `checkpoint`.)

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

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import torch

from . import random as tp_random

FORMAT = "parallel_attention.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_COMPLETE = re.compile(r"step_(\d+)")
_TEMPORARY = re.compile(r"step_\d+\.tmp-.*")
_GROUP_TENSOR = "__param_groups__"  # tensor-valued hyper-parameters: __param_groups__/<group>/<key>


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


def _live_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = {id(p): name for name, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(f"the optimizer holds parameters of shapes {missing} that model.named_parameters() "
                             "does not list: pass the model the optimizer was built for.")
        groups.append([names[id(p)] for p in group["params"]])
    return groups


def optim_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """optimizer.state_dict() with parameter indices replaced by names; hyper-parameters as JSON."""
    live, packed = _live_names(model, optimizer), optimizer.state_dict()
    name_of = {i: n for names, g in zip(live, packed["param_groups"]) for i, n in zip(g["params"], names)}
    tensors, scalars, groups = {}, {}, []
    for gi, (names, group) in enumerate(zip(live, packed["param_groups"])):
        hyper = {"params": names}
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_GROUP_TENSOR}/{gi}/{key}"] = value
            elif key not in ("params", "param_names"):
                hyper[key] = value
        groups.append(hyper)
    for index, state in packed["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{key}/{name_of[index]}"] = value
            else:
                scalars.setdefault(name_of[index], {})[key] = value
    return cpu_tensors(tensors), {"param_groups": json.dumps(groups), "scalar_state": json.dumps(scalars)}


def optim_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict, meta: dict) -> dict:
    """The inverse of `optim_tensors` for this optimizer's parameter indices; CheckpointError on mismatch."""
    saved_groups, scalars = json.loads(meta["param_groups"]), json.loads(meta["scalar_state"])
    live, packed = _live_names(model, optimizer), optimizer.state_dict()
    if len(saved_groups) != len(live):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one {len(live)}.")
    index_of, groups = {}, []
    for gi, (saved, names, group) in enumerate(zip(saved_groups, live, packed["param_groups"])):
        missing, unexpected = sorted(set(names) - set(saved["params"])), sorted(set(saved["params"]) - set(names))
        if missing or unexpected:
            raise CheckpointError(f"optimizer param group {gi}: parameters missing from the checkpoint {missing}, "
                                  f"in the checkpoint but not in this optimizer {unexpected}.")
        index_of.update(zip(names, group["params"]))
        restored = dict(group)
        for key, value in saved.items():
            if key != "params":  # JSON turned tuples (AdamW's betas) into lists
                restored[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        groups.append(restored)
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        kind, rest = key.split("/", 1)
        if kind == _GROUP_TENSOR:
            gi, hyper = rest.split("/", 1)
            groups[int(gi)][hyper] = value
        else:
            state.setdefault(index_of[rest], {})[kind] = value
    for name, values in scalars.items():
        state.setdefault(index_of[name], {}).update(values)
    return {"state": state, "param_groups": groups}


def rng_tensors() -> tuple[dict, dict]:
    """This rank's generators as uint8 tensors (+ JSON metadata), no pickle: the default CPU one, the
    current CUDA device's (one device per rank; only if CUDA is in use, so saving never initialises it),
    the tensor-parallel ones, Python's `random` and NumPy's global state (data pipelines draw from them)."""
    tensors = {"torch/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["torch/cuda"] = torch.cuda.get_rng_state()
    for device_type, state in tp_random.get_tensor_parallel_rng_state().items():
        tensors[f"tensor_parallel/{device_type}"] = state
    version, internal, gauss = random.getstate()
    meta = {"python": json.dumps([version, list(internal), gauss])}
    try:
        import numpy as np
    except ImportError:
        return tensors, meta
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy/keys"] = torch.from_numpy(keys.astype("<u4").view(np.uint8).copy())
    meta["numpy"] = json.dumps([name, int(pos), int(has_gauss), float(cached)])
    return tensors, meta


def set_rng(tensors: dict, meta: dict) -> None:
    torch.set_rng_state(tensors["torch/cpu"])
    if "torch/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch/cuda"])
    saved_tp = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("tensor_parallel/")}
    if saved_tp:
        tp_random.set_tensor_parallel_rng_state(saved_tp)
    version, internal, gauss = json.loads(meta["python"])
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in meta:
        import numpy as np
        name, pos, has_gauss, cached = json.loads(meta["numpy"])
        np.random.set_state((name, tensors["numpy/keys"].numpy().view("<u4").astype(np.uint32), pos, has_gauss, cached))


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


def _sha256(path: Path, fsync: bool) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
        if fsync:
            os.fsync(f.fileno())
        size = f.tell()
    return {"size": size, "sha256": digest.hexdigest()}


def seal_file(path: Path) -> dict:
    """Flush a freshly written file to disk; return the size and sha256 the manifest records."""
    return _sha256(path, fsync=True)


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


def write_manifest(directory: Path, manifest: dict) -> None:
    """Write manifest.json atomically: a temporary file, fsync, rename, fsync of the directory."""
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    fsync_dir(directory)


def read_manifest(directory: str | os.PathLike) -> dict:
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
    actual = _sha256(path, fsync=False)["sha256"]
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
