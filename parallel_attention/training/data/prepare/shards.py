"""Tokenize a corpus once, streaming, into shards of Megatron-LM's indexed format: data format 2.

On disk (`out_dir`):

    shard_00000.bin / .idx, ...   indexed datasets (indexed_dataset.py): one sequence per document, each ending
                                  with the tokenizer's end-of-text id; a shard closes once it holds shard_tokens
    tokenizer.json (+ config)     with tokenizer=bpe: the byte-level BPE trained on this corpus
    meta.json                     written last: settings, counts, and each shard's counts and sha256

Documents are read, encoded (encoding.py) and written in corpus order, one shard after the other, so memory does
not grow with the corpus and any worker count gives byte-identical files. The work happens in `.NAME.partial/`
(partial_output.py): a killed preparation resumes from its finished shards, and `out_dir` is replaced only
once the new data is whole. Validation is not split off here: readers hold out documents by
`document_split.validation_mask`; meta.json's train/val counts say what it gives at `val_fraction`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
from collections import deque
from pathlib import Path

import numpy as np

from ....checkpointing.tensor_io import file_digest
from ...config.schema import DEFAULT_SHARD_TOKENS  # the config owns its defaults
from .corpus import Corpus, train_bpe_on_corpus
from ..document_split import validation_mask
from .encoding import encode_documents, use_threads
from ..indexed_dataset import IndexedDatasetWriter, IndexedTokens, token_dtype
from .partial_output import PartialPreparation
from .progress import PreparationBar, say_if_truncated
from ..token_files import FORMAT_VERSION, META, recorded_meta
from ...tokenizer import TokenizerIdentity, get_tokenizer, trains_bpe

__all__ = ["check_settings", "end_of_text", "prepare_shards", "refuse_replacing", "source_key", "worker_count"]


def prepare_shards(source: str, tokenizer: str, out_dir, val_fraction: float = 0.02, max_bytes: int | None = None,
                   *, text_field: str = "text", bpe_vocab_size: int = 8192, num_workers: int = 0,
                   shard_tokens: int = DEFAULT_SHARD_TOKENS, skip_bad_files: bool = False,
                   overwrite: bool = False) -> dict:
    """Tokenize `source` into shards in `out_dir` (format 2); return meta.json's dict.

    `tokenizer` is "byte", "gpt2", "bpe" (first train a byte-level BPE of `bpe_vocab_size` tokens on the corpus,
    kept as out_dir/tokenizer.json) or a path to a tokenizer.json or a directory holding one. Run it again after a
    kill and it resumes from the finished shards (the same settings and corpus files), byte-identically. A damaged
    corpus file is refused by name, or skipped and counted with `skip_bad_files` (corpus.py). An `out_dir` that
    holds a dataset of another source or tokenizer, or files that are no dataset, is refused unless `overwrite`.
    """
    check_settings(val_fraction, max_bytes, num_workers)
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens} must be positive (default {DEFAULT_SHARD_TOKENS:,}).")
    if not overwrite:
        refuse_replacing(Path(out_dir), source, tokenizer)
    corpus = Corpus(source, text_field, max_bytes, skip_bad_files)
    settings = {"format_version": FORMAT_VERSION, **_spec_key(tokenizer), "source": source_key(source),
                "corpus_files_sha256": _listing_sha256(corpus), "max_bytes": max_bytes, "text_field": text_field,
                "bpe_vocab_size": bpe_vocab_size if trains_bpe(tokenizer) else None, "shard_tokens": shard_tokens,
                "skip_bad_files": skip_bad_files, **_python_version(source)}
    use_threads(worker_count(num_workers))
    with PartialPreparation(out_dir, settings) as partial:
        if trains_bpe(tokenizer) and not (partial.path / "tokenizer.json").is_file():
            _refuse_unless_text(corpus)  # a wrong text field or an empty corpus, named before a BPE is trained
            train_bpe_on_corpus(corpus, bpe_vocab_size, partial.path, Path(out_dir))
        tok = get_tokenizer(tokenizer, partial.path)
        eot = end_of_text(tok)
        _write_shards(corpus, tokenizer, partial, token_dtype(tok.vocab_size), eot, num_workers, shard_tokens)
        say_if_truncated(corpus)
        identity = TokenizerIdentity.of_spec(tokenizer, partial.path)
        meta = {"format": "indexed", "format_version": FORMAT_VERSION, "vocab_size": tok.vocab_size,
                "dtype": token_dtype(tok.vocab_size).name, **identity.meta_fields(),
                "eot_token": eot, "source": settings["source"], "max_bytes": max_bytes, "truncated": corpus.truncated,
                "text_field": text_field, "bpe_vocab_size": settings["bpe_vocab_size"], "val_fraction": val_fraction,
                "shard_tokens": shard_tokens, "skip_bad_files": skip_bad_files, **corpus.stats.summary(),
                **_split_counts(partial.path, partial.shards, val_fraction), **_python_version(source),
                "shards": partial.shards}
        partial.complete(meta)
    return meta


def refuse_replacing(out_dir: Path, source: str, tokenizer: str) -> None:
    """ValueError when preparing into `out_dir` would replace a dataset of another source or tokenizer (a typo in
    --out would destroy hours of preparation), or files that are no prepared dataset, naming both and the fix."""
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    fix = "give another --out (data.data_dir), or pass --overwrite to replace it"
    meta = recorded_meta(out_dir)
    if meta is None:
        raise ValueError(f"{out_dir} holds files but no prepared dataset (no readable {META}): preparing there would "
                         f"replace them; {fix}.")
    have = TokenizerIdentity.from_meta(meta)
    want = TokenizerIdentity(tokenizer, None) if trains_bpe(tokenizer) else TokenizerIdentity.of_spec(tokenizer)
    same_tokenizer = have.name == want.name if want.sha256 is None else have.sha256 == want.sha256
    if meta.get("source") != source_key(source) or not same_tokenizer:
        raise ValueError(f"{out_dir} holds a dataset prepared from {meta.get('source')!r} with the tokenizer "
                         f"{have.describe()} (its {META}); this preparation is of {source_key(source)!r} with "
                         f"{want.describe()}, and would replace it and its index cache: {fix}.")


def _write_shards(corpus: Corpus, spec: str, partial: PartialPreparation, dtype: np.dtype, eot: int,
                  num_workers: int, shard_tokens: int) -> None:
    """Encode the documents the finished shards lack, in order, closing a shard at `shard_tokens` tokens; each
    shard is recorded with the mark of its last document, where a resume starts reading."""
    marks: deque = deque()  # one per document read and not yet written: the encoders' pipeline bounds them
    texts = corpus.documents(partial.next_input, marks)
    if partial.next_input is None and partial.documents_done:  # progress.json of an older release: read, skip
        deque(itertools.islice(texts, partial.documents_done), maxlen=0)
        marks.clear()
    bar = PreparationBar(corpus, partial.documents_done, (partial.next_input or {}).get("disk_read", 0))
    writer, end = None, np.array([eot], dtype=dtype)
    try:
        for tokens in encode_documents(spec, partial.path, texts, worker_count(num_workers)):
            if writer is None:
                writer = IndexedDatasetWriter(partial.next_prefix, dtype)
            writer.add_document(np.concatenate([tokens.astype(dtype), end]))
            mark = marks.popleft()
            bar.update(len(tokens) + 1)
            if writer.num_tokens >= shard_tokens:
                partial.finish_shard(writer, corpus.mark_dict(mark))
                writer = None
        if writer is not None:
            partial.finish_shard(writer, corpus.mark_dict(mark))
            writer = None
    finally:
        bar.close()
        if writer is not None:
            writer.abandon()
    if not partial.shards:
        _refuse_empty(corpus)


def _split_counts(path: Path, shards: list[dict], val_fraction: float) -> dict:
    """Tokens and documents a reader holds out at `val_fraction` (document_split's rule over all documents in
    order); a single document is split by tokens instead: its last max(1, round(n x val_fraction)) are val."""
    total_docs, total_tokens = sum(s["num_documents"] for s in shards), sum(s["num_tokens"] for s in shards)
    if total_docs == 1:
        val = max(1, int(round(total_tokens * val_fraction)))
        return {"num_tokens": total_tokens, "num_train_tokens": total_tokens - val, "num_val_tokens": val,
                "num_train_documents": 1, "num_val_documents": 1,
                "val_split": "the single document's last max(1, round(num_tokens x val_fraction)) tokens"}
    mask, start, val_tokens = validation_mask(total_docs, val_fraction), 0, 0
    for shard in shards:
        lengths = np.diff(IndexedTokens(path / shard["prefix"]).document_starts)
        val_tokens += int(lengths[mask[start:start + len(lengths)]].sum())
        start += len(lengths)
    val_docs = int(mask.sum())
    return {"num_tokens": total_tokens, "num_train_tokens": total_tokens - val_tokens, "num_val_tokens": val_tokens,
            "num_train_documents": total_docs - val_docs, "num_val_documents": val_docs}


def _refuse_unless_text(corpus: Corpus) -> None:
    """Read up to the corpus's first document (its first file, as a rule): refuse a corpus that has none."""
    documents = corpus.documents()
    first = next(documents, None)
    documents.close()
    if first is None:
        _refuse_empty(corpus)


def _refuse_empty(corpus: Corpus) -> None:
    skipped = corpus.stats.summary()
    raise ValueError(f"data.source={corpus.source!r} holds no usable text: {skipped['num_files']} files read, skipped "
                     + (", ".join(f"{n} {why} (first: {skipped['skipped_examples'][why]})"
                                  for why, n in skipped["skipped"].items()) or "nothing")
                     + ": point data.source at UTF-8 text, .jsonl, .jsonl.gz or .parquet documents.")


def _listing_sha256(corpus: Corpus) -> str:
    """The sha256 of the corpus files' names, sizes and mtimes: a resume refuses a corpus that changed."""
    listing = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in corpus.files]
    return hashlib.sha256(json.dumps(listing).encode("utf-8")).hexdigest()


def _spec_key(spec: str) -> dict:
    """The tokenizer as a resume compares it: a trained BPE is part of the work; a file, by its sha256."""
    return {"tokenizer": spec} if trains_bpe(spec) else TokenizerIdentity.of_spec(spec).meta_fields()


def _python_version(source: str) -> dict:
    return {"python_version": sys.version.split()[0]} if source == "stdlib" else {}


def worker_count(num_workers: int) -> int:
    """Encoders for `num_workers` (0: one per CPU core, up to 8)."""
    return num_workers or min(os.cpu_count() or 1, 8)


def source_key(source: str) -> str:
    """The source as recorded in meta.json: "stdlib" or an absolute path, so cwd does not matter."""
    return source if source == "stdlib" else str(Path(source).resolve())


def end_of_text(tokenizer) -> int:
    if tokenizer.eot_token is None:
        raise ValueError(f"tokenizer {tokenizer.name} has no end-of-text token to put between documents: name one "
                         'in a tokenizer_config.json beside its tokenizer.json, e.g. {"eos_token": "</s>"}, with a '
                         "token of its vocabulary.")
    return tokenizer.eot_token


def check_settings(val_fraction: float, max_bytes: int | None, num_workers: int) -> None:
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must lie in (0, 1).")
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes} must be positive, or None for the whole corpus.")
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be 0 (one per CPU core) or a positive process count.")
