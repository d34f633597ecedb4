"""Tokenize a corpus once into token files for pretraining (see data.py for the layout on disk).

Documents come from `corpus.Corpus`; they are encoded in chunks, by `num_workers` spawned processes in
corpus order (byte tokens in this process: there is nothing to gain), so any worker count gives the same
files.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ..checkpointing.tensor_io import file_digest, replace_directory, write_atomic
from .corpus import Corpus, train_bpe_on_corpus
from .token_files import META
from .tokenizer import get_tokenizer, tokenizer_file

__all__ = ["prepare_data", "source_key", "tokenizer_key"]

_CHUNK_BYTES = 1 << 20  # text per task of the tokenizing processes


# ---------------------------------------------------------------------- tokenizing
def _progress(corpus: Corpus, description: str) -> Iterator[str]:
    """The corpus's documents, with a tqdm bar of the bytes read on stderr (when tqdm is there and it is a tty)."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield from corpus.documents()
        return
    with tqdm(total=corpus.size_bytes, desc=description, unit="B", unit_scale=True, file=sys.stderr,
              disable=None) as bar:
        for text in corpus.documents():
            yield text
            bar.update(corpus.stats.num_bytes - bar.n)


def _chunks(texts: Iterable[str]) -> Iterator[list[str]]:
    chunk, size = [], 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= _CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


_worker_tokenizer = None  # each tokenizing process's own tokenizer, built once by _start_worker


def _start_worker(spec: str, data_dir: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already: no threads on top
    _worker_tokenizer = get_tokenizer(spec, data_dir)


def _encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    return _worker_tokenizer.encode_batch(texts)


def _encode(spec: str, data_dir: Path, texts: Iterable[str], num_workers: int) -> Iterator[np.ndarray]:
    """The token arrays of `texts`, in order; encoded by `num_workers` spawned processes unless byte or 1."""
    if num_workers == 1 or spec == "byte":
        tokenizer = get_tokenizer(spec, data_dir)
        for chunk in _chunks(texts):
            yield from tokenizer.encode_batch(chunk)
        return
    chunks = _chunks(texts)
    context = multiprocessing.get_context("spawn")  # fork would copy a tokenizer's threads and locks
    with context.Pool(num_workers, initializer=_start_worker, initargs=(spec, str(data_dir))) as pool:
        while window := list(itertools.islice(chunks, 2 * num_workers)):  # bounded: the corpus never sits in RAM
            for arrays in pool.imap(_encode_in_worker, window):
                yield from arrays


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


def source_key(source: str) -> str:
    """The source as recorded in meta.json: "stdlib" or an absolute path, so cwd does not matter."""
    return source if source == "stdlib" else str(Path(source).resolve())


def tokenizer_key(spec: str, data_dir) -> dict:
    """The tokenizer as meta.json records it: "byte", "gpt2", "bpe" or the absolute path of its tokenizer.json,
    and the sha256 of that file (of data_dir/tokenizer.json for "bpe"), so a changed tokenizer is noticed."""
    if spec in ("byte", "gpt2"):
        return {"tokenizer": spec, "tokenizer_sha256": None}
    path = Path(data_dir) / "tokenizer.json" if spec == "bpe" else tokenizer_file(spec).resolve()
    sha = file_digest(path)["sha256"] if path.is_file() else None
    return {"tokenizer": spec if spec == "bpe" else str(path), "tokenizer_sha256": sha}


def _end_of_text(tokenizer) -> int:
    if tokenizer.eot_token is None:
        raise ValueError(f"tokenizer {tokenizer.name} has no end-of-text token to put between documents: name one "
                         'in a tokenizer_config.json beside its tokenizer.json, e.g. {"eos_token": "</s>"}, with a '
                         "token of its vocabulary.")
    return tokenizer.eot_token


def _check_settings(val_fraction: float, max_bytes: int | None, num_workers: int) -> None:
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must lie in (0, 1).")
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes} must be positive, or None for the whole corpus.")
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be 0 (one per CPU core) or a positive process count.")


def prepare_data(source: str, tokenizer: str, out_dir, val_fraction: float = 0.02, max_bytes: int | None = None,
                 *, text_field: str = "text", bpe_vocab_size: int = 8192, num_workers: int = 0) -> dict:
    """Tokenize `source` into `out_dir` (train/val .bin and .idx, meta.json); return the meta dict.

    `tokenizer` is "byte", "gpt2", "bpe" (first train a byte-level BPE of `bpe_vocab_size` tokens on the
    corpus, saved as out_dir/tokenizer.json) or a path to a tokenizer.json or a directory holding one.
    The meta holds the summary: files, documents, tokens, and what was skipped (`skipped`: count by reason,
    `skipped_examples`: where each reason first occurred). Deterministic: the same source and settings give
    byte-identical files whatever `num_workers`. Everything is written into a staging directory beside
    `out_dir` that replaces it only when complete: a failed or interrupted run leaves an existing
    prepared dataset as it was.
    """
    _check_settings(val_fraction, max_bytes, num_workers)
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
    eot = np.array([_end_of_text(tok)], dtype=dtype)
    workers = num_workers or min(os.cpu_count() or 1, 8)
    arrays = [np.concatenate([a.astype(dtype), eot])
              for a in _encode(tokenizer, out, _progress(corpus, "tokenizing"), workers)]
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
