"""Pretraining data: tokenize a corpus once into flat token files, then read them as memmaps.

On disk (`data_dir`):

    train.bin / val.bin    every document's tokens followed by the end-of-text token, concatenated, raw
                           little-endian uint16 (uint32 when vocab_size >= 65536)
    train.idx / val.idx    the start offset of each document in its .bin, little-endian uint64
    tokenizer.json         with data.tokenizer=bpe: the byte-level BPE trained on this corpus
    meta.json              written last, so a directory without it is not complete data (and is refused);
                           it records each .bin's sha256, checked when the files are opened (token_files.py)
    .sha256-cache.json     those hashes, kept while the files are unchanged (token_files.sha256_of)

Preparation (tokenizing the corpus) lives in preparation.py. Batches are drawn by `batches.GlobalBatchSampler`
and `batches.validation_batches`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from ..checkpointing.tensor_io import write_atomic
from .preparation import source_key, tokenizer_key
from .preparation import prepare_shards as prepare_data
from .token_files import (DataFileError, check_ids_in_vocab, meta_and_reason, prepare_again, refuse_other_settings,
                          verify_files, verify_sha256)
from .tokenizer import TOKENIZER_FILES

__all__ = ["TokenDataset", "ensure_prepared", "prepare_data", "read_meta"]

def read_meta(data_dir) -> dict | None:
    """meta.json of a complete preparation whose token (and offset) files have the recorded sizes, else None."""
    return meta_and_reason(data_dir)[0]


def ensure_prepared(data_cfg, tokenizer_dir=None) -> dict:
    """The meta of `data_cfg.data_dir`, prepared first if it does not exist (or is empty; an unfinished
    preparation of the same settings resumes), then its files verified against their sha256; the tokenizer's
    files (tokenizer.json and its configs, for Hugging Face tokenizers) copied to `tokenizer_dir`.

    A directory that holds anything else is refused with a DataFileError before any step, never rewritten: data
    prepared with another source, tokenizer (name or sha256), text_field, max_bytes or bpe_vocab_size (and, for
    the previous format, val_fraction), or no complete data at all. Call on one rank only (then barrier).
    """
    data_dir = Path(data_cfg.data_dir)
    meta, why = meta_and_reason(data_dir)
    if meta is None and data_dir.is_dir() and any(data_dir.iterdir()):
        raise DataFileError(f"data.data_dir={str(data_dir)!r} holds no complete prepared data ({why}), and a run "
                            f"never rewrites data it did not prepare: {prepare_again(data_dir)}.")
    bpe = data_cfg.tokenizer == "bpe"
    if meta is None:
        print(f"preparing data in {data_dir}: {why if data_dir.is_dir() else 'it does not exist yet'}",
              file=sys.stderr, flush=True)
        meta = prepare_data(data_cfg.source, data_cfg.tokenizer, data_dir, val_fraction=data_cfg.val_fraction,
                            max_bytes=data_cfg.max_bytes, text_field=data_cfg.text_field,
                            bpe_vocab_size=data_cfg.bpe_vocab_size, num_workers=data_cfg.num_workers,
                            shard_tokens=data_cfg.shard_tokens)
    else:
        wanted = {**tokenizer_key(data_cfg.tokenizer, data_dir), "source": source_key(data_cfg.source),
                  "max_bytes": data_cfg.max_bytes, "text_field": data_cfg.text_field,
                  "bpe_vocab_size": data_cfg.bpe_vocab_size if bpe else None}
        if meta.get("format_version") is None:  # the previous format split train/val when it was prepared
            wanted["val_fraction"] = data_cfg.val_fraction
        refuse_other_settings(data_dir, meta, wanted)
        verify_files(data_dir, meta)  # on rank 0 first: it fills the hash cache that the other ranks then read
    if tokenizer_dir is not None and meta.get("tokenizer_sha256") is not None:
        _copy_tokenizer(data_dir / "tokenizer.json" if bpe else Path(meta["tokenizer"]), Path(tokenizer_dir))
    return meta


def _copy_tokenizer(path: Path, dest: Path) -> None:
    """`path` as dest/tokenizer.json, with the tokenizer_config.json and special_tokens_map.json beside it."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        source = path if name == "tokenizer.json" else path.parent / name
        if source.is_file():
            write_atomic(dest / name, [source.read_bytes()])


class TokenDataset:
    """One split's tokens as a read-only memmap: pages are read on demand and shared between processes.

    `doc_offsets` (uint64 memmap) holds each document's start; None for data prepared before they were kept."""

    def __init__(self, data_dir, split: str, verify: bool = True) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r} must be 'train' or 'val'.")
        meta, why = meta_and_reason(data_dir)
        if meta is None:
            raise DataFileError(f"{data_dir} holds no complete prepared data ({why}): {prepare_again(data_dir)}.")
        if verify:  # before any step: a changed file is refused, not trained on
            verify_sha256(data_dir, meta, split)
        self.meta, self.path = meta, Path(data_dir) / f"{split}.bin"
        self.vocab_size = int(meta["vocab_size"])
        self.num_tokens = int(meta[f"num_{split}_tokens"])
        self.tokens = np.memmap(self.path, dtype=np.dtype(meta["dtype"]).newbyteorder("<"),
                                mode="r", shape=(self.num_tokens,))
        self.num_documents = meta.get(f"num_{split}_documents")
        self.doc_offsets = None if not self.num_documents else \
            np.memmap(Path(data_dir) / f"{split}.idx", dtype="<u8", mode="r", shape=(self.num_documents,))

    def document(self, index: int) -> np.ndarray:
        """The tokens of document `index` of this split, its end-of-text token included."""
        if self.doc_offsets is None:
            raise ValueError("this data was prepared without document offsets: prepare it again to get them.")
        end = int(self.doc_offsets[index + 1]) if index + 1 < self.num_documents else self.num_tokens
        return self.tokens[int(self.doc_offsets[index]):end]

    def windows(self, offsets, length: int) -> torch.Tensor:
        """LongTensor [len(offsets), length]: the tokens starting at each offset."""
        offsets = np.asarray(offsets).tolist()
        if not offsets:
            return torch.empty(0, length, dtype=torch.long)
        rows = np.stack([np.asarray(self.tokens[o:o + length], dtype=np.int64) for o in offsets])
        check_ids_in_vocab(rows, self.vocab_size, self.path, offsets)
        return torch.from_numpy(rows)
