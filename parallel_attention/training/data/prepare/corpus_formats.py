"""The documents of one corpus file, by its kind, and what was skipped in it and why (`CorpusStats`).

    .jsonl, .jsonl.gz   one document per line: the string `text_field` of its JSON object
    .parquet            one per row of the `text_field` column (pyarrow)
    .arrow              one per row of the `text_field` column of a `datasets` save_to_disk directory (pyarrow)

pyarrow is an optional extra (`pip install parallel_attention[data]`), imported when such a file is read.
A datasets directory is recognised by its state.json and dataset_info.json; its arrow files are read in the
order its state.json lists them (a DatasetDict's splits in the order of its dataset_dict.json).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ....hf.config import read_json_object

__all__ = ["CHECKED", "DAMAGED", "DROPPED", "READERS", "CorpusStats", "DamagedFile", "datasets_files", "file_kind",
           "is_datasets_directory"]

# Reasons something is skipped; each names its unit.
BINARY, EMPTY_FILE, OTHER_TYPE = "binary or not UTF-8 files", "empty files", "files of another type"
BAD_LINE, NO_COLUMN, EMPTY_DOC = "bad JSON lines", "parquet files without the text column", "empty documents"
DAMAGED = "damaged or unreadable files"
DROPPED = "documents of damaged files"  # read before the damage showed, dropped with their file
CHECKED = frozenset({".jsonl.gz", ".parquet", ".arrow"})  # damage shows only at a member's (or the file's) end


class DamagedFile(Exception):
    """A corpus file that cannot be read to its end (truncated, corrupt, missing): the reader stops there.
    `documents`: how many it gave before (corpus.py counts them when it drops the file)."""

    documents = 0


@dataclass
class CorpusStats:
    """What one pass over a corpus read: files, documents, UTF-8 bytes kept, and the skipped counts by reason
    with the first place each reason occurred."""

    num_files: int = 0
    num_documents: int = 0
    num_bytes: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)
    # where the reader stands in the current file: (offset, item) after its last record, and disk bytes consumed
    at: tuple = (0, 0)
    disk_in_file: int = 0
    _frozen: tuple | None = field(default=None, repr=False, compare=False)

    def frozen(self) -> tuple[dict, dict]:
        """The skipped counts and examples as they stand, copied only after they change (a mark per document)."""
        if self._frozen is None:
            self._frozen = (dict(sorted(self.skipped.items())), dict(sorted(self.examples.items())))
        return self._frozen

    def skip(self, reason: str, where: str, count: int = 1) -> None:
        self.skipped[reason] += count
        self.examples.setdefault(reason, where)
        self._frozen = None

    def summary(self) -> dict:
        return {"num_files": self.num_files, "num_documents": self.num_documents, "num_bytes": self.num_bytes,
                "skipped": dict(sorted(self.skipped.items())), "skipped_examples": dict(sorted(self.examples.items()))}


def file_kind(path: Path) -> str:
    """".jsonl.gz" for a gzipped jsonl file, else the lower-case suffix."""
    return ".jsonl.gz" if path.name.lower().endswith(".jsonl.gz") else path.suffix.lower()


def _jsonl_documents(path: Path, where: str, text_field: str, stats: CorpusStats,
                     start: tuple[int, int] = (0, 0)) -> Iterator[str]:
    """One document per non-blank line: the string `text_field` of its JSON object; other lines are skipped, but a
    file whose first object lacks `text_field` is refused, naming the keys it has (the wrong --text-field).
    `start` (offset in the decompressed text, line number) resumes after a line, seeking instead of parsing."""
    checked, gz = start != (0, 0), file_kind(path) == ".jsonl.gz"
    stats.num_files += not checked
    try:
        with (gzip.open(path, "rb") if gz else path.open("rb")) as f:
            f.seek(start[0])  # a gzip file decompresses up to there; a plain one only moves
            disk = f.fileobj if gz else f
            for lineno, line in enumerate(f, start[1] + 1):
                stats.at, stats.disk_in_file = (f.tell(), lineno), disk.tell()
                if not line.strip():
                    continue
                value = _json_object(line)
                if not checked and value is not None:
                    checked = True
                    _check_field(value, text_field, f"{where}:{lineno}")
                text = None if value is None else value.get(text_field)
                if not isinstance(text, str):
                    stats.skip(BAD_LINE, f"{where}:{lineno} (not a JSON object with a string {text_field!r})")
                elif not text.strip():
                    stats.skip(EMPTY_DOC, f"{where}:{lineno}")
                else:
                    yield text
    except (OSError, EOFError, zlib.error) as error:  # gzip's BadGzipFile is an OSError
        raise DamagedFile(f"{type(error).__name__}: {error}") from error


def _json_object(line: bytes) -> dict | None:
    try:
        value = json.loads(line)
    except ValueError:  # bad JSON and bad UTF-8 alike
        return None
    return value if isinstance(value, dict) else None


def _check_field(first: dict, text_field: str, where: str) -> None:
    if text_field not in first:
        keys = ", ".join(repr(k) for k in list(first)[:20]) or "none"
        raise ValueError(f"data.text_field={text_field!r} is not a key of the first JSON object of {where} (its keys: "
                         f"{keys}): pass the key that holds the text as --text-field (data.text_field in a config).")


def _pyarrow(where: str):
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401  (the submodule, for _parquet_documents)
    except ImportError as error:
        raise ImportError(f"{where}: reading .parquet and datasets' .arrow files needs pyarrow: pip install pyarrow "
                          f"(or pip install parallel_attention[data]).") from error
    return pyarrow


def _parquet_documents(path: Path, where: str, text_field: str, stats: CorpusStats,
                       start: tuple[int, int] = (0, 0)) -> Iterator[str]:
    """One document per row of the `text_field` column, read in record batches; a file without it is skipped.
    `start` (0, row) resumes at a row, skipping the row groups before it unread."""
    pa = _pyarrow(where)
    with _damage_named(pa):
        table = pa.parquet.ParquetFile(path)
        if text_field not in table.schema_arrow.names:
            stats.skip(NO_COLUMN, f"{where} (columns: {', '.join(table.schema_arrow.names)}; set data.text_field)")
            return
        stats.num_files += start == (0, 0)
        first, skip = 0, start[1]
        while first < table.num_row_groups and table.metadata.row_group(first).num_rows <= skip:
            skip -= table.metadata.row_group(first).num_rows
            first += 1
        groups = list(range(first, table.num_row_groups))
        batches = (batch.column(0) for batch in table.iter_batches(columns=[text_field], batch_size=1024,
                                                                   row_groups=groups))
        yield from _rows(_after(batches, skip), where, stats, start[1])


def _arrow_documents(path: Path, where: str, text_field: str, stats: CorpusStats,
                     start: tuple[int, int] = (0, 0)) -> Iterator[str]:
    """One document per row of a datasets arrow file (an IPC stream); a missing column is an error, not a skip:
    every file of the directory has the same columns. `start` (0, row) resumes at a row."""
    pa = _pyarrow(where)
    with _damage_named(pa), pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_stream(source)
        names = reader.schema.names
        if text_field not in names:
            raise ValueError(f"data.text_field={text_field!r} is not a column of the datasets directory "
                             f"{path.parent} (columns: {', '.join(names)}): set data.text_field (--text-field) to "
                             "its text column.")
        stats.num_files += start == (0, 0)
        columns = (batch.column(names.index(text_field)) for batch in reader)
        yield from _rows(_after(columns, start[1]), where, stats, start[1])


def _after(columns, skip: int):
    """The columns without their first `skip` rows (memory-mapped or skipped batches are never converted)."""
    for column in columns:
        if skip >= len(column):
            skip -= len(column)
            continue
        yield column.slice(skip)
        skip = 0


@contextlib.contextmanager
def _damage_named(pa):
    """pyarrow's read errors (a file that is not parquet, a truncated one, a missing arrow file) as DamagedFile."""
    try:
        yield
    except (OSError, pa.ArrowException) as error:  # ArrowInvalid is also a ValueError: caught here first
        raise DamagedFile(f"{type(error).__name__}: {error}") from error


def _rows(columns, where: str, stats: CorpusStats, row: int = 0) -> Iterator[str]:
    for column in columns:
        for value in column.to_pylist():
            row += 1
            stats.at = (0, row)
            if isinstance(value, str) and value.strip():
                yield value
            else:
                stats.skip(EMPTY_DOC, f"{where} row {row}")


READERS = {".jsonl": _jsonl_documents, ".jsonl.gz": _jsonl_documents, ".parquet": _parquet_documents,
           ".arrow": _arrow_documents}


def is_datasets_directory(path: Path) -> bool:
    """A directory written by `datasets`' save_to_disk: a Dataset's (state.json, dataset_info.json) or a
    DatasetDict's (dataset_dict.json)."""
    return ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()) or \
        (path / "dataset_dict.json").is_file()


def datasets_files(path: Path) -> list[Path]:
    """The arrow files of a save_to_disk directory, in the order of its rows."""
    if (path / "dataset_dict.json").is_file():
        splits = read_json_object(path / "dataset_dict.json").get("splits", [])
        return [file for split in splits for file in datasets_files(path / split)]
    names = [entry["filename"] for entry in read_json_object(path / "state.json").get("_data_files", [])]
    return [path / name for name in names]
