"""A resumed preparation starts reading where its last finished shard ended (issue 39 item 5): progress.json records
each shard's next input (the file, the .jsonl's byte offset or the row), so the documents the finished shards hold
are never parsed again, and the result is byte-identical to a preparation that never stopped, its counts included.
The progress bar's bytes are bytes on disk (a .jsonl.gz's compressed ones): it reaches the corpus's size."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from parallel_attention.training.data.prepare import corpus_formats
from parallel_attention.training.data.prepare.corpus import Corpus
from parallel_attention.training.data.prepare.partial_output import PartialPreparation
from parallel_attention.training.data.prepare.shards import prepare_shards

TEXTS = [f"doc {i:03d} " + "words of text " * (2 + i % 5) for i in range(121)]


@pytest.fixture
def corpus(tmp_path) -> Path:
    """Every kind a shard can end in: text files, .jsonl, .jsonl.gz and parquet of several row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text(TEXTS[0])
    (root / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[1:41]))
    (root / "c.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n"
                                                            for t in TEXTS[41:81]).encode()))
    pq.write_table(pa.table({"text": TEXTS[81:120]}), root / "d.parquet", row_group_size=7)
    (root / "e.md").write_text(TEXTS[120])
    return root


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _kill_after(monkeypatch, shards: int) -> None:
    real = PartialPreparation.finish_shard

    def finish_then_die(self, writer, *rest):
        real(self, writer, *rest)
        if len(self.shards) == shards:
            raise KeyboardInterrupt

    monkeypatch.setattr(PartialPreparation, "finish_shard", finish_then_die)


def _reads(monkeypatch) -> list[str]:
    """The texts of every .jsonl line parsed and every parquet row converted from here on."""
    parsed, json_object, rows = [], corpus_formats._json_object, corpus_formats._rows

    def counted_json(line: bytes):
        value = json_object(line)
        parsed.append(value["text"])
        return value

    def counted_rows(columns, *args):
        return rows((c for c in columns if parsed.extend(c.to_pylist()) or True), *args)

    monkeypatch.setattr(corpus_formats, "_json_object", counted_json)
    monkeypatch.setattr(corpus_formats, "_rows", counted_rows)
    return parsed


@pytest.mark.parametrize("killed_after", [1, 4, 9, 13, 18])
def test_a_resume_reads_only_the_documents_after_the_finished_shards(corpus, tmp_path, monkeypatch, killed_after):
    whole = prepare_shards(str(corpus), "byte", tmp_path / "whole", shard_tokens=300)
    assert len(whole["shards"]) > 18
    _kill_after(monkeypatch, killed_after)
    with pytest.raises(KeyboardInterrupt):
        prepare_shards(str(corpus), "byte", tmp_path / "out", shard_tokens=300)
    monkeypatch.undo()
    done = sum(s["num_documents"] for s in whole["shards"][:killed_after])
    reads = _reads(monkeypatch)
    assert prepare_shards(str(corpus), "byte", tmp_path / "out", shard_tokens=300) == whole
    assert _files(tmp_path / "out") == _files(tmp_path / "whole")
    # nothing the finished shards hold was parsed again; everything after them was parsed once
    structured = TEXTS[1:120]
    assert reads == [t for t in structured if TEXTS.index(t) >= done]


def test_the_marks_count_text_and_disk_bytes_to_the_end(corpus):
    reading = Corpus(str(corpus))
    marks: list = []
    texts = list(reading.documents(marks=marks))  # a list takes the deque's place: only append is used
    assert texts == TEXTS and len(marks) == len(TEXTS)
    last = reading.mark_dict(marks[-1])
    assert last["num_bytes"] == sum(len(t.encode()) for t in TEXTS) == reading.stats.num_bytes
    assert reading.disk_read == reading.disk_bytes == sum(p.stat().st_size for p in corpus.iterdir())
    after_b = reading.mark_dict(marks[40])  # the last line of b.jsonl: its whole size on disk is consumed
    assert (after_b["file_name"], after_b["at"]) == ("b.jsonl", [(corpus / "b.jsonl").stat().st_size, 40])
    full = reading.stats.summary()
    for resume_at in (0, 40, 60, 100, 119):  # in text files, .jsonl, .jsonl.gz, parquet
        resumed = list(reading.documents(start=reading.mark_dict(marks[resume_at])))
        assert resumed == TEXTS[resume_at + 1:] and reading.stats.summary() == full
        assert reading.disk_read == reading.disk_bytes
