"""The documents of a pretraining corpus, and what was skipped on the way and why.

A source is "stdlib" (this interpreter's standard-library .py files: the offline default), one file, or a
directory searched recursively (hidden entries and __pycache__ left out) holding

    text files (.txt, .md, .py, ... see TEXT_SUFFIXES)   one document per file
    .jsonl                                                one per line: the `text_field` of its JSON object
    .parquet (pyarrow)                                    one per row: the `text_field` column

Files are read in the order of their sorted relative paths, so a source always gives the same documents.
A file that is not UTF-8 text (binary), an empty one, one of another type, a bad JSON line or a parquet file
without the column is skipped and counted in `CorpusStats.skipped` under its reason.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .tokenizer import train_bpe

__all__ = ["Corpus", "CorpusStats", "TEXT_SUFFIXES"]

TEXT_SUFFIXES = frozenset({
    ".txt", ".md", ".rst", ".tex", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".rs", ".go", ".java",
    ".kt", ".scala", ".js", ".ts", ".jsx", ".tsx", ".rb", ".php", ".pl", ".lua", ".jl", ".r", ".swift", ".cs",
    ".sh", ".sql", ".html", ".htm", ".css", ".xml", ".yaml", ".yml", ".toml", ".ini", ".cfg",
})
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}

# Reasons something is skipped; each names its unit.
BINARY, EMPTY_FILE, OTHER_TYPE = "binary or not UTF-8 files", "empty files", "files of another type"
BAD_LINE, NO_COLUMN, EMPTY_DOC = "bad JSON lines", "parquet files without the text column", "empty documents"


@dataclass
class CorpusStats:
    """What one pass over a corpus read: files, documents, UTF-8 bytes kept, and the skipped counts by reason
    with the first place each reason occurred."""

    num_files: int = 0
    num_documents: int = 0
    num_bytes: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        self.examples.setdefault(reason, where)

    def summary(self) -> dict:
        return {"num_files": self.num_files, "num_documents": self.num_documents, "num_bytes": self.num_bytes,
                "skipped": dict(sorted(self.skipped.items())), "skipped_examples": dict(sorted(self.examples.items()))}


class Corpus:
    """The documents of `source`, cut to `max_bytes` UTF-8 bytes in all; iterate `documents()` once per pass."""

    def __init__(self, source: str, text_field: str = "text", max_bytes: int | None = None) -> None:
        self.source, self.text_field, self.max_bytes = source, text_field, max_bytes
        self.root, self.files, self._walk_skips = _source_files(source)
        self.stats = CorpusStats()

    @property
    def size_bytes(self) -> int:
        """The bytes on disk this pass will read at most (for a progress bar)."""
        total = sum(path.stat().st_size for path in self.files)
        return total if self.max_bytes is None else min(total, self.max_bytes)

    def documents(self) -> Iterator[str]:
        """Every document's text, NUL removed (the byte tokenizer's separator); fills a fresh `self.stats`."""
        self.stats = stats = CorpusStats()
        for where in self._walk_skips:
            stats.skip(OTHER_TYPE, where)
        for path in self.files:
            where = path.relative_to(self.root).as_posix()
            read = self._read(path, where)
            for text in read:
                data = text.replace("\x00", "").encode("utf-8")
                if self.max_bytes is not None and stats.num_bytes + len(data) > self.max_bytes:
                    data = data[: self.max_bytes - stats.num_bytes].decode("utf-8", errors="ignore").encode("utf-8")
                if data:
                    stats.num_documents += 1
                    stats.num_bytes += len(data)
                    yield data.decode("utf-8")
                if self.max_bytes is not None and stats.num_bytes >= self.max_bytes:
                    read.close()
                    return

    def _read(self, path: Path, where: str) -> Iterator[str]:
        """The documents of one file, counting it as read unless the whole file is skipped."""
        stats = self.stats
        if path.stat().st_size == 0:
            stats.skip(EMPTY_FILE, where)
            return
        if path.suffix == ".jsonl":
            stats.num_files += 1
            yield from _jsonl_documents(path, where, self.text_field, stats)
        elif path.suffix == ".parquet":
            yield from _parquet_documents(path, where, self.text_field, stats)
        else:
            text = _decode_text(path.read_bytes())
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
    if not path.is_dir():
        raise ValueError(f"data.source={source!r} is neither 'stdlib' nor an existing file or directory: give a "
                         f"corpus directory of text, .jsonl or .parquet files, or 'stdlib'.")
    files, other = [], []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for name in filenames:
            if not name.startswith("."):
                file = Path(dirpath, name)
                kind = file.suffix.lower()
                (files if kind in TEXT_SUFFIXES or kind in (".jsonl", ".parquet") else other).append(file)
    key = lambda p: p.relative_to(path).as_posix()  # noqa: E731
    return path, sorted(files, key=key), sorted(key(p) for p in other)


def _decode_text(data: bytes) -> str | None:
    """The text of a file's bytes, or None when they are binary (a NUL byte) or not UTF-8."""
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _jsonl_documents(path: Path, where: str, text_field: str, stats: CorpusStats) -> Iterator[str]:
    """One document per non-blank line: the string `text_field` of its JSON object; other lines are skipped."""
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[text_field]
            except (ValueError, KeyError, TypeError, IndexError):  # ValueError covers bad JSON and bad UTF-8
                text = None
            if not isinstance(text, str):
                stats.skip(BAD_LINE, f"{where}:{lineno} (not a JSON object with a string {text_field!r})")
            elif not text.strip():
                stats.skip(EMPTY_DOC, f"{where}:{lineno}")
            else:
                yield text


def _parquet_documents(path: Path, where: str, text_field: str, stats: CorpusStats) -> Iterator[str]:
    """One document per row of the `text_field` column, read in record batches."""
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ImportError(f"{where}: reading .parquet files needs pyarrow: pip install pyarrow "
                          f"(or pip install parallel_attention[data]).") from error
    table = pq.ParquetFile(path)
    if text_field not in table.schema_arrow.names:
        stats.skip(NO_COLUMN, f"{where} (columns: {', '.join(table.schema_arrow.names)}; set data.text_field)")
        return
    stats.num_files += 1
    row = 0
    for batch in table.iter_batches(columns=[text_field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            row += 1
            if isinstance(value, str) and value.strip():
                yield value
            else:
                stats.skip(EMPTY_DOC, f"{where} row {row}")


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
