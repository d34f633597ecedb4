"""Pretraining data: tokenize a corpus once into flat token files, then read them as memmaps.

On disk (`data_dir`):

    train.bin / val.bin    every document's tokens followed by the end-of-text token, concatenated, raw
                           little-endian uint16 (uint32 when vocab_size >= 65536)
    train.idx / val.idx    the start offset of each document in its .bin, little-endian uint64
    tokenizer.json         with data.tokenizer=bpe: the byte-level BPE trained on this corpus
    meta.json              written last, so a directory without it is an unfinished preparation and is redone;
                           it records each .bin's sha256, checked when the files are opened (token_files.py)
    .sha256-cache.json     those hashes, kept while the files are unchanged (token_files.sha256_of)

Documents come from `corpus.Corpus`; they are encoded in chunks, by `num_workers` spawned processes in
corpus order (byte tokens in this process: there is nothing to gain), so any worker count gives the same
files. Batches are drawn by `batches.GlobalBatchSampler` and `batches.validation_batches`.
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
import torch

from ..checkpointing.tensor_io import file_digest, replace_directory, write_atomic
from .corpus import Corpus, train_bpe_on_corpus
from .token_files import (META, DataFileError, check_ids_in_vocab, meta_and_reason, prepare_again,
                          settings_changed, verify_sha256)
from .tokenizer import TOKENIZER_FILES, get_tokenizer, tokenizer_file

__all__ = ["TokenDataset", "ensure_prepared", "prepare_data", "read_meta"]

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


def _source_key(source: str) -> str:
    """The source as recorded in meta.json: "stdlib" or an absolute path, so cwd does not matter."""
    return source if source == "stdlib" else str(Path(source).resolve())


def _tokenizer_key(spec: str, data_dir) -> dict:
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
    meta = {"vocab_size": tok.vocab_size, "dtype": dtype.name, **_tokenizer_key(tokenizer, out),
            "eot_token": int(eot[0]), "source": _source_key(source), "max_bytes": max_bytes,
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


def read_meta(data_dir) -> dict | None:
    """meta.json of a complete preparation whose token (and offset) files have the recorded sizes, else None."""
    return meta_and_reason(data_dir)[0]


def ensure_prepared(data_cfg, tokenizer_dir=None) -> dict:
    """Return the meta of `data_cfg.data_dir` if it was prepared with these settings and its token files have the
    recorded sha256 (DataFileError if not), else prepare it, saying why on stderr; then copy the tokenizer's files
    (tokenizer.json and its configs, for Hugging Face tokenizers) to `tokenizer_dir`.

    Call on one rank only (then barrier): it touches files, never collectives.
    """
    meta, why = meta_and_reason(data_cfg.data_dir)
    bpe = data_cfg.tokenizer == "bpe"
    wanted = {**_tokenizer_key(data_cfg.tokenizer, data_cfg.data_dir), "source": _source_key(data_cfg.source),
              "max_bytes": data_cfg.max_bytes, "val_fraction": data_cfg.val_fraction,
              "text_field": data_cfg.text_field, "bpe_vocab_size": data_cfg.bpe_vocab_size if bpe else None}
    why = why or settings_changed(meta, wanted)
    if why:
        print(f"preparing data in {data_cfg.data_dir}: {why}", file=sys.stderr, flush=True)
        meta = prepare_data(data_cfg.source, data_cfg.tokenizer, data_cfg.data_dir, val_fraction=data_cfg.val_fraction,
                            max_bytes=data_cfg.max_bytes, text_field=data_cfg.text_field,
                            bpe_vocab_size=data_cfg.bpe_vocab_size, num_workers=data_cfg.num_workers)
    else:  # on rank 0 first: it fills the hash cache that the other ranks then read
        for split in ("train", "val"):
            verify_sha256(data_cfg.data_dir, meta, split)
    if tokenizer_dir is not None and meta.get("tokenizer_sha256") is not None:
        _copy_tokenizer(Path(data_cfg.data_dir) / "tokenizer.json" if bpe else Path(meta["tokenizer"]),
                        Path(tokenizer_dir))
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
