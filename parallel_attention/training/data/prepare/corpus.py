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
is refused by name, or, with `skip_bad_files`, skipped whole and counted among the skipped, with its documents.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time
from collections import deque
from pathlib import Path
from typing import Iterator

from .corpus_formats import (BINARY, CHECKED, DAMAGED, DROPPED, EMPTY_FILE, OTHER_TYPE, READERS, CorpusStats,
                             DamagedFile, datasets_files, file_kind, is_datasets_directory)
from .bpe import train_bpe

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
        self._disk_done = 0  # bytes on disk of the files this pass has finished

    @property
    def disk_bytes(self) -> int:
        """The size of the corpus files on disk (compressed, for a .jsonl.gz)."""
        return sum(path.stat().st_size for path in self.files)

    @property
    def disk_read(self) -> int:
        """The bytes on disk that the current pass has consumed: the finished files, and the current file so far
        (a .jsonl's position; other files count once finished). It reaches disk_bytes at the corpus's end."""
        return self._disk_done + self.stats.disk_in_file

    def documents(self, start: dict | None = None, marks: deque | None = None) -> Iterator[str]:
        """Every document's text, NUL removed (the byte tokenizer's separator); fills a fresh `self.stats`.

        With `marks`, a mark (`mark_dict` makes it JSON) is appended before each document is yielded: where the
        reading stands after it, with the counts so far. `start`, such a mark, resumes there without reading the
        documents before it (a .jsonl seeks to its offset, parquet and arrow files skip their rows)."""
        first, at = self._begin(start)
        stats = self.stats
        if self.max_bytes is not None and stats.num_bytes >= self.max_bytes:
            return
        for index in range(first, len(self.files)):
            path = self.files[index]
            read = self._read(path, path.relative_to(self.root).as_posix(), at if index == first else (0, 0))
            for text in read:
                data = text.replace("\x00", "").encode("utf-8")
                if self.max_bytes is not None and stats.num_bytes + len(data) > self.max_bytes:
                    data = data[: self.max_bytes - stats.num_bytes].decode("utf-8", errors="ignore").encode("utf-8")
                    self.truncated = True
                stats.num_documents += bool(data)
                stats.num_bytes += len(data)
                done = self.max_bytes is not None and stats.num_bytes >= self.max_bytes
                if done:  # whether anything is left decides `truncated`, before the mark records it
                    here = stats.at
                    self.truncated = self.truncated or index != len(self.files) - 1 or next(read, None) is not None
                    read.close()
                    stats.at = here
                if data:
                    if marks is not None:
                        marks.append((index, stats.at, stats.num_files, stats.num_documents, stats.num_bytes,
                                      self.truncated, stats.frozen(), self.disk_read))
                    yield data.decode("utf-8")
                if done:
                    return
            self._disk_done, stats.disk_in_file = self._disk_done + path.stat().st_size, 0

    def _begin(self, start: dict | None) -> tuple[int, tuple[int, int]]:
        """A fresh pass's stats (those of `start`, to resume there): the file index and position to read from."""
        self.stats, self.truncated, self._disk_done = (stats := CorpusStats()), False, 0
        if start is None:
            for where in self._walk_skips:
                stats.skip(OTHER_TYPE, where)
            for path in self._missing:
                stats.skip(DAMAGED, f"{path.relative_to(self.root).as_posix()} (missing)")
            return 0, (0, 0)
        for key in ("num_files", "num_documents", "num_bytes"):
            setattr(stats, key, start[key])
        stats.skipped.update(start["skipped"])
        stats.examples.update(start["skipped_examples"])
        self.truncated = start["truncated"]
        self._disk_done = sum(path.stat().st_size for path in self.files[:start["file"]])
        return start["file"], tuple(start["at"])

    def mark_dict(self, mark: tuple) -> dict:
        """A mark of `documents` as JSON for progress.json (the file named too, for whoever reads it)."""
        index, at, num_files, num_documents, num_bytes, truncated, (skipped, examples), disk_read = mark
        return {"file": index, "file_name": self.files[index].relative_to(self.root).as_posix(), "at": list(at),
                "num_files": num_files, "num_documents": num_documents, "num_bytes": num_bytes,
                "skipped": skipped, "skipped_examples": examples, "truncated": truncated, "disk_read": disk_read}

    def _read(self, path: Path, where: str, start: tuple[int, int]) -> Iterator[str]:
        """The documents of one file from `start`, counting it as read unless the whole file is skipped; a damaged
        file is refused, or, with `skip_bad_files`, skipped whole and counted with its documents.

        gzip checks a member's CRC only at its end, and a truncated parquet or arrow file shows only where it
        stops, so the documents read before the damage may be altered: with `skip_bad_files`, such a file is read
        through once before any of its documents is kept (it is decompressed twice)."""
        stats = self.stats
        stats.at, stats.disk_in_file = start, 0
        if path.stat().st_size == 0:
            stats.skip(EMPTY_FILE, where)
            return
        reader = READERS.get(file_kind(path), _text_document)
        try:
            if self.skip_bad_files and file_kind(path) in CHECKED:
                _read_through(reader, path, where, self.text_field, start)
            yield from reader(path, where, self.text_field, stats, start)
        except DamagedFile as error:
            if not self.skip_bad_files:
                raise ValueError(_damaged_message(path, str(error))) from None
            dropped = error.documents
            stats.skip(DAMAGED, f"{where} ({error}; all of it dropped, the {dropped} documents read before the damage "
                                "too)")
            if dropped:
                stats.skip(DROPPED, where, dropped)


def _read_through(reader, path: Path, where: str, text_field: str, start: tuple[int, int]) -> None:
    """Read a file to its end, keeping nothing: DamagedFile, with the count of documents read before the damage
    (`documents`), if it cannot be."""
    documents = 0
    try:
        for _ in reader(path, where, text_field, CorpusStats(), start):
            documents += 1
    except DamagedFile as error:
        error.documents = documents
        raise


def _text_document(path: Path, where: str, text_field: str, stats: CorpusStats,
                   start: tuple[int, int] = (0, 0)) -> Iterator[str]:
    """A text file as one document; a binary or empty one is skipped. `start` (0, 1): read already."""
    if start != (0, 0):
        return
    stats.at = (0, 1)
    try:
        text = _decode_text(data := path.read_bytes())
    except OSError as error:
        raise DamagedFile(f"{type(error).__name__}: {error}") from error
    if text is None:
        stats.skip(BINARY, where)
    elif not text.strip():
        stats.skip(EMPTY_FILE, where)
    else:
        stats.num_files += 1
        stats.disk_in_file = len(data)
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
            "scripts/prepare_data.py to skip such files whole (counted in meta.json's skipped, with their "
            "documents).")


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
    amount = "all the text" if corpus.max_bytes is None else f"up to {corpus.max_bytes / 1e6:.1f} MB of text"
    print(f"training a byte-level BPE of {vocab_size} tokens on {amount} of {corpus.source} "
          f"({corpus.disk_bytes / 1e6:.1f} MB on disk; kept as {final / 'tokenizer.json'}: runs with the same data "
          "settings reuse it)", file=sys.stderr, flush=True)
    start = time.perf_counter()  # on a terminal, the library's own bars (they cover the reading too)
    trained = train_bpe(corpus.documents(), vocab_size, out / "tokenizer.json", show_progress=sys.stderr.isatty())
    print(f"trained the BPE ({trained.vocab_size} tokens) on {corpus.stats.num_bytes / 1e6:.1f} MB in "
          f"{corpus.stats.num_documents} documents in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
