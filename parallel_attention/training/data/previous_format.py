"""The previous releases' data, kept readable in this one place: data format 1 and the random windows of runs started
before epochs existed.

Data format 1 is the previous release's prepared directory: `train.bin` and
`val.bin` split when the data was prepared, with `train.idx` / `val.idx` document offsets (which directories
prepared before offsets were kept lack), and a meta.json without "format_version". The format-2 path (shards of
Megatron-LM's indexed format) asks one question, token_files.is_previous_format, and hands such a directory to the
functions here; a run on format-2 data never enters this module. `random_window_offsets` is how runs started before
0.3 drew their windows (data.sampling=random_windows, which run.resume.keep_previous_sampling sets for them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

__all__ = ["SPLITS", "offsets_problem", "random_window_offsets", "read_splits", "recorded_hashes", "recorded_sizes"]

SPLITS = ("train", "val")


def recorded_sizes(meta: dict, itemsize: int) -> dict[str, int]:
    """Each file's size in bytes from meta.json's counts (an .idx only where offsets were kept)."""
    sizes = {f"{s}.bin": meta[f"num_{s}_tokens"] * itemsize for s in SPLITS}
    sizes.update({f"{s}.idx": meta[f"num_{s}_documents"] * 8 for s in SPLITS if f"num_{s}_documents" in meta})
    return sizes


def recorded_hashes(meta: dict) -> dict[str, str]:
    """{file: sha256} of the .bin files meta.json hashed (none for the .idx files: their offsets are checked)."""
    return {f"{s}.bin": meta[f"{s}_sha256"] for s in SPLITS if meta.get(f"{s}_sha256")}


def offsets_problem(data_dir: Path, meta: dict) -> str | None:
    """What is wrong with a split's .idx (document starts from 0, increasing, inside its tokens), or None."""
    for split in SPLITS:
        count, path = meta.get(f"num_{split}_documents"), data_dir / f"{split}.idx"
        if not count:
            continue
        starts = np.fromfile(path, dtype="<u8", count=count).astype(np.int64)
        if starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= meta[f"num_{split}_tokens"]:
            return (f"{path} does not hold increasing document offsets from 0 inside the "
                    f"{meta[f'num_{split}_tokens']} tokens of {split}.bin")
    return None


def read_splits(path: str, meta: dict) -> list[tuple[np.ndarray, Path, np.ndarray, np.ndarray]]:
    """Per split (train, val): its tokens memory-mapped, its .bin path, and its documents' starts and lengths (one
    document when no offsets were kept)."""
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    splits = []
    for split in SPLITS:
        count = int(meta[f"num_{split}_tokens"])
        tokens = np.memmap(Path(path) / f"{split}.bin", dtype=dtype, mode="r", shape=(count,))
        documents = meta.get(f"num_{split}_documents")
        starts = np.asarray(np.memmap(Path(path) / f"{split}.idx", dtype="<u8", mode="r", shape=(documents,)),
                            dtype=np.int64) if documents else np.zeros(1, dtype=np.int64)
        splits.append((tokens, Path(path) / f"{split}.bin", starts, np.diff(np.append(starts, count))))
    return splits


def random_window_offsets(seed: int, step: int, count: int, high: int) -> np.ndarray:
    """The window offsets in [0, high) of the `count` samples of `step`, drawn with replacement from a generator
    seeded with (seed, step), exactly as runs started before 0.3 drew them."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) % (1 << 63))
    return torch.randint(0, high, (count,), generator=generator).numpy()
