"""The previous format's writer (train/val .bin, .idx offsets, meta.json without "format_version"), which the
trainer reads until the format-2 reader lands; `preparation.prepare_shards` then replaces `prepare_data` and this
file goes.
"""

from __future__ import annotations

import json
import secrets
import shutil
import sys
from pathlib import Path

import numpy as np

from ..checkpointing.tensor_io import replace_directory, write_atomic
from .corpus import Corpus, train_bpe_on_corpus
from .encoding import encode_documents
from .preparation import check_settings, end_of_text, source_key, tokenizer_key, worker_count
from .token_files import META
from .tokenizer import get_tokenizer

__all__ = ["prepare_data"]


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
        raise ValueError("the data source holds no text: nothing to train on (see the skipped files in the summary).")
    if len(arrays) == 1:
        cut = max(1, len(arrays[0]) - max(1, int(round(len(arrays[0]) * val_fraction))))
        return [arrays[0][:cut]], [arrays[0][cut:]]
    val_ids = {i for i in range(len(arrays)) if _is_val(i, val_fraction)} or {len(arrays) - 1}
    return [a for i, a in enumerate(arrays) if i not in val_ids], [arrays[i] for i in sorted(val_ids)]


def _write_split(out: Path, split: str, parts: list[np.ndarray], meta: dict) -> None:
    """`split`.bin (the tokens) and `split`.idx (each document's start offset), recorded in `meta`."""
    starts = np.cumsum([0] + [len(a) for a in parts[:-1]], dtype=np.uint64).astype("<u8")
    meta[f"num_{split}_tokens"] = int(sum(len(a) for a in parts))
    meta[f"num_{split}_documents"] = len(parts)
    meta[f"{split}_sha256"] = write_atomic(out / f"{split}.bin", (a.tobytes() for a in parts))
    write_atomic(out / f"{split}.idx", [starts.tobytes()])




def prepare_data(source: str, tokenizer: str, out_dir, val_fraction: float = 0.02, max_bytes: int | None = None,
                 *, text_field: str = "text", bpe_vocab_size: int = 8192, num_workers: int = 0,
                 shard_tokens: int | None = None) -> dict:
    """Tokenize `source` into `out_dir` (train/val .bin and .idx, meta.json); return the meta dict.

    `tokenizer` is "byte", "gpt2", "bpe" (first train a byte-level BPE of `bpe_vocab_size` tokens on the
    corpus, saved as out_dir/tokenizer.json) or a path to a tokenizer.json or a directory holding one.
    The meta holds the summary: files, documents, tokens, and what was skipped (`skipped`: count by reason,
    `skipped_examples`: where each reason first occurred). Deterministic: the same source and settings give
    byte-identical files whatever `num_workers`. Everything is written into a staging directory beside
    `out_dir` that replaces it only when complete: a failed or interrupted run leaves an existing
    prepared dataset as it was. `shard_tokens` is ignored: this format has no shards.
    """
    check_settings(val_fraction, max_bytes, num_workers)
    final = Path(out_dir)
    nonce = secrets.token_hex(6)
    out = final.parent / f".{final.name}.staging-{nonce}"  # the existing dataset stays untouched until the end
    out.mkdir(parents=True)
    try:
        meta = _prepare_into(out, final, source, tokenizer, val_fraction, max_bytes, text_field, bpe_vocab_size,
                             num_workers)
        replace_directory(out, final, nonce)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return meta


def _prepare_into(out: Path, final: Path, source: str, tokenizer: str, val_fraction: float, max_bytes: int | None,
                  text_field: str, bpe_vocab_size: int, num_workers: int) -> dict:
    """Prepare into the staging directory `out`, which becomes `final` once complete."""
    corpus = Corpus(source, text_field, max_bytes)
    if tokenizer == "bpe":
        train_bpe_on_corpus(corpus, bpe_vocab_size, out, final)
    tok = get_tokenizer(tokenizer, out)
    dtype = np.dtype("<u2" if tok.vocab_size < 65536 else "<u4")
    eot = np.array([end_of_text(tok)], dtype=dtype)
    arrays = [np.concatenate([a.astype(dtype), eot])
              for a in encode_documents(tokenizer, out, corpus.documents(), worker_count(num_workers))]
    meta = {"vocab_size": tok.vocab_size, "dtype": dtype.name, **tokenizer_key(tokenizer, out),
            "eot_token": int(eot[0]), "source": source_key(source), "max_bytes": max_bytes,
            "val_fraction": val_fraction, "text_field": text_field,
            "bpe_vocab_size": bpe_vocab_size if tokenizer == "bpe" else None, **corpus.stats.summary()}
    if source == "stdlib":
        meta["python_version"] = sys.version.split()[0]
    if not arrays:
        skipped = corpus.stats.summary()
        raise ValueError(f"data.source={source!r} holds no usable text: {skipped['num_files']} files read, skipped "
                         + (", ".join(f"{n} {why} (first: {skipped['skipped_examples'][why]})"
                                      for why, n in skipped["skipped"].items()) or "nothing")
                         + ": point data.source at UTF-8 text, .jsonl or .parquet documents.")
    for split, parts in zip(("train", "val"), _split(arrays, val_fraction)):
        _write_split(out, split, parts, meta)
    write_atomic(out / META, [json.dumps(meta, indent=2).encode("utf-8")])
    return meta
