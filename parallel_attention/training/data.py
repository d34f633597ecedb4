"""Pretraining data: tokenize a corpus once into flat token files, then sample batches from them.

On disk (`data_dir`): `train.bin`, `val.bin` — every document's tokens followed by the end-of-text
token, concatenated, raw little-endian uint16 (uint32 when vocab_size >= 65536) — and `meta.json`,
written last, so a directory without it is an unfinished preparation and is redone.

Batches are a pure function of (seed, step): the offsets of the global batch's windows are drawn from
a generator seeded with (seed, step), and data-parallel rank r takes rows [r*n/dp, (r+1)*n/dp). Ranks of
one tensor-parallel group (same dp rank) therefore see identical batches, the union over dp ranks is the
same global batch for any layout, and a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

from ..checkpointing.tensor_io import write_atomic
from .tokenizer import get_tokenizer

__all__ = ["GlobalBatchSampler", "TokenDataset", "ensure_prepared", "prepare_data", "read_meta", "validation_batches"]

META = "meta.json"
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# ---------------------------------------------------------------------- reading the corpus
def _source_files(source: str) -> tuple[Path, list[Path]]:
    """The corpus files in a fixed order (sorted relative paths), and the root they are relative to."""
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
            files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    else:
        path = Path(source)
        if path.is_file():
            return path.parent, [path]
        if not path.is_dir():
            raise ValueError(f"data.source={source!r} is neither 'stdlib' nor an existing file or directory.")
        root, files = path, [p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file()]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _documents(path: Path):
    """Yield the texts of one file: a .jsonl line's "text" field, otherwise the whole file."""
    if path.suffix != ".jsonl":
        yield path.read_bytes().decode("utf-8", errors="replace")
        return
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a 'text' field ({exc}).") from exc
            yield str(text)


def _read_corpus(source: str, max_bytes: int | None) -> tuple[list[str], int, int]:
    """The documents of the source, cut to `max_bytes` UTF-8 bytes in total; files read; bytes kept."""
    _, files = _source_files(source)
    docs, used, num_files = [], 0, 0
    for path in files:
        num_files += 1
        for text in _documents(path):
            data = text.replace("\x00", "").encode("utf-8")  # NUL is the byte tokenizer's document separator
            if max_bytes is not None and used + len(data) > max_bytes:
                data = data[: max_bytes - used].decode("utf-8", errors="ignore").encode("utf-8")
            if data:
                docs.append(data.decode("utf-8"))
                used += len(data)
            if max_bytes is not None and used >= max_bytes:
                return docs, num_files, used
    return docs, num_files, used


# ---------------------------------------------------------------------- writing token files
def _is_val(index: int, val_fraction: float) -> bool:
    """Document `index` goes to validation when index * val_fraction crosses an integer: every ~1/f-th one."""
    return int((index + 1) * val_fraction) > int(index * val_fraction)


def _split(arrays: list[np.ndarray], val_fraction: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split documents (each ending in eot) into train / val.

    Every ~1/val_fraction-th document goes to validation, so val samples the whole corpus rather than its
    tail (the last stdlib modules alphabetically). With too few documents for that, the last document is
    val; a single document is cut at its last val_fraction of tokens.
    """
    if not arrays:
        raise ValueError("the data source holds no text: nothing to train on.")
    if len(arrays) == 1:
        cut = max(1, len(arrays[0]) - max(1, int(round(len(arrays[0]) * val_fraction))))
        return [arrays[0][:cut]], [arrays[0][cut:]]
    val_ids = {i for i in range(len(arrays)) if _is_val(i, val_fraction)} or {len(arrays) - 1}
    return [a for i, a in enumerate(arrays) if i not in val_ids], [arrays[i] for i in sorted(val_ids)]


def _source_key(source: str) -> str:
    """The source as recorded in meta.json: "stdlib" or an absolute path, so cwd does not matter."""
    return source if source == "stdlib" else str(Path(source).resolve())


def prepare_data(source: str, tokenizer: str, out_dir, val_fraction: float = 0.02,
                 max_bytes: int | None = None) -> dict:
    """Tokenize `source` into `out_dir`/{train,val}.bin and meta.json; return the meta dict.

    Deterministic: the same source and settings give byte-identical files. meta.json is removed first
    and written last, each file atomically, so an interrupted run never leaves a directory that looks done.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must lie in (0, 1).")
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes} must be positive, or None for the whole corpus.")
    tok = get_tokenizer(tokenizer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / META).unlink(missing_ok=True)
    for stale in out.glob(".*.tmp-*"):
        stale.unlink()

    docs, num_files, num_bytes = _read_corpus(source, max_bytes)
    dtype = np.dtype("<u2" if tok.vocab_size < 65536 else "<u4")
    eot = np.array([tok.eot_token], dtype=dtype)
    arrays = [np.concatenate([tok.encode_array(doc).astype(dtype), eot]) for doc in docs]
    train, val = _split(arrays, val_fraction)

    meta = {
        "vocab_size": tok.vocab_size, "dtype": dtype.name, "tokenizer": tok.name, "eot_token": tok.eot_token,
        "num_train_tokens": int(sum(len(a) for a in train)), "num_val_tokens": int(sum(len(a) for a in val)),
        "source": _source_key(source), "max_bytes": max_bytes, "val_fraction": val_fraction,
        "num_files": num_files, "num_documents": len(docs), "num_bytes": num_bytes,
    }
    if source == "stdlib":
        meta["python_version"] = sys.version.split()[0]
    for split, parts in (("train", train), ("val", val)):
        meta[f"{split}_sha256"] = write_atomic(out / f"{split}.bin", (a.tobytes() for a in parts))
    write_atomic(out / META, [json.dumps(meta, indent=2).encode("utf-8")])
    return meta


def read_meta(data_dir) -> dict | None:
    """meta.json of a complete preparation whose token files have the recorded sizes, else None."""
    path = Path(data_dir) / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        itemsize = np.dtype(meta["dtype"]).itemsize
        for split in ("train", "val"):
            if (Path(data_dir) / f"{split}.bin").stat().st_size != meta[f"num_{split}_tokens"] * itemsize:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta


def ensure_prepared(data_cfg) -> dict:
    """Return the meta of `data_cfg.data_dir` if it was prepared with these settings, else prepare it.

    Call on one rank only (then barrier): it touches files, never collectives.
    """
    meta = read_meta(data_cfg.data_dir)
    wanted = {"tokenizer": data_cfg.tokenizer, "source": _source_key(data_cfg.source),
              "max_bytes": data_cfg.max_bytes, "val_fraction": data_cfg.val_fraction}
    if meta is not None and all(meta.get(k) == v for k, v in wanted.items()):
        return meta
    return prepare_data(data_cfg.source, data_cfg.tokenizer, data_cfg.data_dir,
                        val_fraction=data_cfg.val_fraction, max_bytes=data_cfg.max_bytes)


# ---------------------------------------------------------------------- reading batches
class TokenDataset:
    """One split's tokens as a read-only memmap: pages are read on demand and shared between processes."""

    def __init__(self, data_dir, split: str) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r} must be 'train' or 'val'.")
        meta = read_meta(data_dir)
        if meta is None:
            raise FileNotFoundError(f"{data_dir} holds no complete prepared data: run scripts/prepare_data.py "
                                    f"or ensure_prepared(cfg.data) first.")
        self.meta = meta
        self.vocab_size = int(meta["vocab_size"])
        self.num_tokens = int(meta[f"num_{split}_tokens"])
        self.tokens = np.memmap(Path(data_dir) / f"{split}.bin", dtype=np.dtype(meta["dtype"]).newbyteorder("<"),
                                mode="r", shape=(self.num_tokens,))

    def windows(self, offsets, length: int) -> torch.Tensor:
        """LongTensor [len(offsets), length]: the tokens starting at each offset."""
        rows = [np.asarray(self.tokens[o:o + length], dtype=np.int64) for o in np.asarray(offsets).tolist()]
        return torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, length, dtype=torch.long)


def _check_fits(dataset: TokenDataset, seq_len: int) -> None:
    if dataset.num_tokens < seq_len + 1:
        raise ValueError(f"the split holds {dataset.num_tokens} tokens, fewer than seq_len+1={seq_len + 1}: "
                         f"use a shorter data.seq_len, a larger corpus or a larger data.val_fraction.")


def _split_rows(rows: torch.Tensor, micro_batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut [n, s+1] rows into micro-batches of (tokens [mb, s], labels [mb, s]), labels shifted by one."""
    return [(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()) for chunk in rows.split(micro_batch_size)]


class GlobalBatchSampler:
    """Global batches of `global_batch_size` random windows of seq_len+1 tokens, a pure function of (seed, step)."""

    def __init__(self, dataset: TokenDataset, seq_len: int, global_batch_size: int, seed: int) -> None:
        _check_fits(dataset, seq_len)
        self.dataset, self.seq_len, self.global_batch_size, self.seed = dataset, seq_len, global_batch_size, seed

    def offsets(self, step: int) -> torch.Tensor:
        """Start offsets of the global batch of `step`; cheap, so every rank computes all of them."""
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + step) % (1 << 63))
        high = self.dataset.num_tokens - self.seq_len  # last valid start + 1
        return torch.randint(0, high, (self.global_batch_size,), generator=generator)

    def global_batch(self, step: int) -> torch.Tensor:
        """LongTensor [global_batch_size, seq_len + 1]."""
        return self.dataset.windows(self.offsets(step), self.seq_len + 1)

    def local_micro_batches(self, step: int, dp_rank: int, dp_size: int,
                            micro_batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This data-parallel rank's rows of the global batch, as (tokens, labels) micro-batches [mb, seq_len].

        Only this rank's rows are read from disk.
        """
        per_rank = _rows_per_rank(self.global_batch_size, dp_rank, dp_size, micro_batch_size)
        mine = self.offsets(step)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        return _split_rows(self.dataset.windows(mine, self.seq_len + 1), micro_batch_size)


def _rows_per_rank(batch_size: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> int:
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size}).")
    if batch_size % (dp_size * micro_batch_size) != 0:
        raise ValueError(f"batch size {batch_size} is not a multiple of micro_batch_size={micro_batch_size} x "
                         f"data-parallel size {dp_size}.")
    return batch_size // dp_size


def validation_batches(dataset: TokenDataset, seq_len: int, batch_size: int, num_batches: int, *,
                       dp_rank: int = 0, dp_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of `num_batches` (tokens, labels) batches of evenly spaced windows over the split.

    The same windows at every evaluation, so val losses are comparable over a run. With dp_size > 1 each
    rank gets its rows [dp_rank*b/dp, (dp_rank+1)*b/dp) of every batch; average the losses over dp ranks.
    """
    _check_fits(dataset, seq_len)
    per_rank = _rows_per_rank(batch_size, dp_rank, dp_size, 1)
    starts = np.linspace(0, dataset.num_tokens - seq_len - 1, batch_size * num_batches).round().astype(np.int64)
    batches = []
    for b in range(num_batches):
        mine = starts[b * batch_size + dp_rank * per_rank: b * batch_size + (dp_rank + 1) * per_rank]
        batches += _split_rows(dataset.windows(mine, seq_len + 1), per_rank)
    return batches
