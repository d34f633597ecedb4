"""The documents of a pretraining corpus, and what was skipped on the way and why.

A source is "stdlib" (this interpreter's standard-library .py files: the offline default), one file, or a
directory searched recursively (hidden entries and __pycache__ left out) holding

    text files (.txt, .md, .py, ... see TEXT_SUFFIXES)   one document per file
    .jsonl, .jsonl.gz                                     one per line: the `text_field` of its JSON object
    .parquet (pyarrow)                                    one per row: the `text_field` column

or a directory written by Hugging Face `datasets`' save_to_disk (recognised by its state.json and
dataset_info.json): one document per row of its `text_field` column, its arrow files in their order.

Files are read in the order of their sorted relative paths, so a source always gives the same documents.
A file that is not UTF-8 text (binary), an empty one, one of another type, a bad JSON line or a parquet file
without the column is skipped and counted in `CorpusStats.skipped` under its reason. A damaged file (a truncated or
corrupt .jsonl.gz, a parquet or arrow file pyarrow cannot read, an arrow file a datasets directory lists but lacks)
is refused by name, or, with `skip_bad_files`, counted among the skipped: the documents read before the damage stay.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Iterator

from .corpus_formats import (BINARY, DAMAGED, EMPTY_FILE, OTHER_TYPE, READERS, CorpusStats, DamagedFile,
                             datasets_files, file_kind, is_datasets_directory)
from .tokenizer import train_bpe

__all__ = ["Corpus", "CorpusStats", "TEXT_SUFFIXES", "train_bpe_on_corpus"]

TEXT_SUFFIXES = frozenset({
    ".txt", ".md", ".rst", ".tex", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".rs", ".go", ".java",
    ".kt", ".scala", ".js", ".ts", ".jsx", ".tsx", ".rb", ".php", ".pl", ".lua", ".jl", ".r", ".swift", ".cs",
    ".sh", ".sql", ".html", ".htm", ".css", ".xml", ".yaml", ".yml", ".toml", ".ini", ".cfg",
})
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}



class Corpus:
    """The documents of `source`, cut to `max_bytes` UTF-8 bytes in all; iterate `documents()` once per pass."""

    def __init__(self, source: str, text_field: str = "text", max_bytes: int | None = None,
                 skip_bad_files: bool = False) -> None:
        self.source, self.text_field, self.max_bytes = source, text_field, max_bytes
        self.skip_bad_files = skip_bad_files
        self.root, self.files, self._walk_skips = _source_files(source)
        self._missing = [p for p in self.files if not p.is_file()]  # listed by a datasets directory's state.json
        if self._missing and not skip_bad_files:
            raise ValueError(_damaged_message(self._missing[0], "it is missing", len(self._missing)))
        self.files = [p for p in self.files if p not in self._missing]
        self.stats = CorpusStats()
        self.truncated = False  # max_bytes stopped the last pass before the corpus's end

    @property
    def disk_bytes(self) -> int:
        """The size of the corpus files on disk."""
        return sum(path.stat().st_size for path in self.files)

    @property
    def size_bytes(self) -> int:
        """The bytes on disk this pass will read at most (for a progress bar)."""
        return self.disk_bytes if self.max_bytes is None else min(self.disk_bytes, self.max_bytes)

    def documents(self) -> Iterator[str]:
        """Every document's text, NUL removed (the byte tokenizer's separator); fills a fresh `self.stats`."""
        self.stats, self.truncated = (stats := CorpusStats()), False
        for where in self._walk_skips:
            stats.skip(OTHER_TYPE, where)
        for path in self._missing:
            stats.skip(DAMAGED, f"{path.relative_to(self.root).as_posix()} (missing)")
        for path in self.files:
            where = path.relative_to(self.root).as_posix()
            read = self._read(path, where)
            for text in read:
                data = text.replace("\x00", "").encode("utf-8")
                if self.max_bytes is not None and stats.num_bytes + len(data) > self.max_bytes:
                    data = data[: self.max_bytes - stats.num_bytes].decode("utf-8", errors="ignore").encode("utf-8")
                    self.truncated = True
                if data:
                    stats.num_documents += 1
                    stats.num_bytes += len(data)
                    yield data.decode("utf-8")
                if self.max_bytes is not None and stats.num_bytes >= self.max_bytes:
                    self.truncated = self.truncated or path != self.files[-1] or next(read, None) is not None
                    read.close()
                    return

    def _read(self, path: Path, where: str) -> Iterator[str]:
        """The documents of one file, counting it as read unless the whole file is skipped; a damaged file is
        refused, or skipped and counted with `skip_bad_files`."""
        stats = self.stats
        if path.stat().st_size == 0:
            stats.skip(EMPTY_FILE, where)
            return
        kept = stats.num_documents
        try:
            yield from READERS.get(file_kind(path), _text_document)(path, where, self.text_field, stats)
        except DamagedFile as error:
            if not self.skip_bad_files:
                raise ValueError(_damaged_message(path, str(error))) from None
            stats.skip(DAMAGED, f"{where} ({error}; the {stats.num_documents - kept} documents before the damage "
                                "kept)")


def _text_document(path: Path, where: str, text_field: str, stats: CorpusStats) -> Iterator[str]:
    """A text file as one document; a binary or empty one is skipped."""
    try:
        text = _decode_text(path.read_bytes())
    except OSError as error:
        raise DamagedFile(f"{type(error).__name__}: {error}") from error
    if text is None:
        stats.skip(BINARY, where)
    elif not text.strip():
        stats.skip(EMPTY_FILE, where)
    else:
        stats.num_files += 1
        yield text


def _source_files(source: str) -> tuple[Path, list[Path], list[str]]:
    """The root, the corpus files in sorted relative-path order, and the files left out for their type."""
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
            files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
        return root, sorted(files, key=lambda p: p.relative_to(root).as_posix()), []
    path = Path(source)
    if path.is_file():
        return path.parent, [path], []
    if is_datasets_directory(path):
        return path, datasets_files(path), []
    if not path.is_dir():
        raise ValueError(f"data.source={source!r} is neither 'stdlib' nor an existing file or directory: give a "
                         f"corpus directory of text, .jsonl, .jsonl.gz or .parquet files, a directory written by "
                         f"datasets' save_to_disk, or 'stdlib'.")
    files, other = [], []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for name in filenames:
            if not name.startswith("."):
                file = Path(dirpath, name)
                kind = file_kind(file)
                (files if kind in TEXT_SUFFIXES or kind in READERS and kind != ".arrow" else other).append(file)
    key = lambda p: p.relative_to(path).as_posix()  # noqa: E731
    return path, sorted(files, key=key), sorted(key(p) for p in other)


def _damaged_message(path: Path, why: str, count: int = 1) -> str:
    others = f" (and {count - 1} more like it)" if count > 1 else ""
    return (f"{path}{others} cannot be read to its end ({why}): the corpus file is truncated, corrupt or missing. "
            "Replace it with a good copy (or delete it) and prepare again, or pass --skip-bad-files to "
            "scripts/prepare_data.py to skip such files (counted in meta.json's skipped, with the documents read "
            "before the damage kept).")


def _decode_text(data: bytes) -> str | None:
    """The text of a file's bytes, or None when they are binary (a NUL byte) or not UTF-8."""
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def train_bpe_on_corpus(corpus: Corpus, vocab_size: int, out: Path, final: Path) -> None:
    """Train the BPE into `out`, saying on stderr what it trains, on how much text and where it is kept, then how
    long it took: it is the slow part of preparing (tens of seconds for a few MB on a small CPU)."""
    print(f"training a byte-level BPE of {vocab_size} tokens on up to {corpus.size_bytes / 1e6:.1f} MB of text "
          f"from {corpus.source} (kept as {final / 'tokenizer.json'}: runs with the same data settings reuse it)",
          file=sys.stderr, flush=True)
    start = time.perf_counter()  # on a terminal, the library's own bars (they cover the reading too)
    trained = train_bpe(corpus.documents(), vocab_size, out / "tokenizer.json", show_progress=sys.stderr.isatty())
    print(f"trained the BPE ({trained.vocab_size} tokens) on {corpus.stats.num_bytes / 1e6:.1f} MB in "
          f"{corpus.stats.num_documents} documents in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
