"""Damaged corpus files (issue 39 item 4): a truncated or corrupt .jsonl.gz, a parquet file pyarrow cannot read and a
datasets directory that lacks an arrow file are refused naming the file and the fix, before anything a rerun would
take for finished is written; with skip_bad_files (--skip-bad-files) they are skipped and counted instead. A .jsonl
whose objects lack the text field is named with the keys found, before a BPE is trained."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from launch import ROOT, run_command
from parallel_attention.training.data.prepare.shards import prepare_shards

TEXTS = [f"document {i}: " + "some words " * (4 + i % 7) for i in range(400)]


def _lines(texts) -> bytes:
    return b"".join(json.dumps({"text": t}).encode("utf-8") + b"\n" for t in texts)


def _gz_corpus(root: Path, damage) -> Path:
    """good.jsonl.gz (the first 100 texts) and bad.jsonl.gz (the rest), the latter's compressed bytes `damage`d."""
    root.mkdir()
    (root / "a_good.jsonl.gz").write_bytes(gzip.compress(_lines(TEXTS[:100])))
    (root / "b_bad.jsonl.gz").write_bytes(damage(gzip.compress(_lines(TEXTS[100:]))))
    return root


def _left(tmp_path: Path) -> list[str]:
    """What a refused preparation left beside the corpus (nothing: no out/, no .out.partial/, no lock)."""
    return sorted(p.name for p in tmp_path.iterdir() if p.name != "corpus")


DAMAGES = {"truncated": lambda data: data[: len(data) // 2],
           "corrupt": lambda data: data[:40] + bytes(b ^ 0xFF for b in data[40:80]) + data[80:],
           "not gzip": lambda data: b"plain bytes, no gzip header" * 10}


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_a_damaged_jsonl_gz_is_refused_by_name_and_leaves_nothing(tmp_path, damage, tokenizer):
    corpus = _gz_corpus(tmp_path / "corpus", DAMAGES[damage])
    with pytest.raises(ValueError) as info:
        prepare_shards(str(corpus), tokenizer, tmp_path / "out", bpe_vocab_size=300)
    message = str(info.value)
    assert f"{corpus / 'b_bad.jsonl.gz'} cannot be read to its end" in message, message
    assert "--skip-bad-files" in message and "Replace it with a good copy" in message
    assert _left(tmp_path) == []


def test_a_damaged_file_is_skipped_and_counted_on_request(tmp_path):
    corpus = _gz_corpus(tmp_path / "corpus", DAMAGES["truncated"])
    meta = prepare_shards(str(corpus), "byte", tmp_path / "out", skip_bad_files=True)
    with gzip.open(corpus / "b_bad.jsonl.gz", "rb") as f:  # exactly the whole lines a reader gets before the damage
        readable = f.read1(1 << 30)  # all that decompresses, at most
    dropped = min(readable.count(b"\n"), 300)
    assert dropped > 0 and meta["num_documents"] == 100 and meta["skip_bad_files"] is True
    assert meta["skipped"] == {"damaged or unreadable files": 1, "documents of damaged files": dropped}
    example = meta["skipped_examples"]["damaged or unreadable files"]
    assert example.startswith("b_bad.jsonl.gz (EOFError") and f"the {dropped} documents read before" in example


def test_a_crc_failure_drops_the_documents_it_altered(tmp_path):
    """gzip finds a flipped byte only at the member's end: the documents read before it, one of them altered,
    go with the file."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    stored = bytearray(gzip.compress(_lines(TEXTS[100:]), compresslevel=0))  # stored blocks: the bytes as they are
    at = stored.index(b"document 150: ") + len("document 150: ")
    stored[at] ^= 0x01  # "some" -> "rome": still a JSON line, another text
    (corpus / "b_bad.jsonl.gz").write_bytes(bytes(stored))
    (corpus / "a_good.jsonl.gz").write_bytes(gzip.compress(_lines(TEXTS[:100])))
    meta = prepare_shards(str(corpus), "byte", tmp_path / "out", skip_bad_files=True)
    assert meta["num_documents"] == 100 and meta["skipped"]["documents of damaged files"] == 300
    assert "CRC check failed" in meta["skipped_examples"]["damaged or unreadable files"]
    with gzip.open(corpus / "b_bad.jsonl.gz", "rb") as f:  # the altered line decompresses before the CRC fails
        assert b"document 150: rome words" in f.read1(1 << 30)
    kept = b"".join(np.fromfile(path, dtype=meta["dtype"]).astype(np.uint8).tobytes()
                    for path in sorted((tmp_path / "out").glob("*.bin")))  # the byte tokenizer's ids are the bytes
    assert b"document 99: " in kept and b"document 150" not in kept


def _parquet_corpus(root: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir()
    pq.write_table(pa.table({"text": TEXTS[:50]}), root / "a.parquet")
    pq.write_table(pa.table({"text": TEXTS[50:]}), root / "b.parquet")
    data = (root / "b.parquet").read_bytes()
    (root / "b.parquet").write_bytes(data[: len(data) // 2])  # the footer and its magic bytes gone
    return root


def test_an_unreadable_parquet_file_is_refused_or_skipped(tmp_path):
    pytest.importorskip("pyarrow")
    corpus = _parquet_corpus(tmp_path / "corpus")
    with pytest.raises(ValueError, match=f"{corpus / 'b.parquet'} cannot be read to its end .*--skip-bad-files"):
        prepare_shards(str(corpus), "byte", tmp_path / "out")
    assert _left(tmp_path) == []
    meta = prepare_shards(str(corpus), "byte", tmp_path / "out", skip_bad_files=True)
    assert meta["num_documents"] == 50 and meta["skipped"]["damaged or unreadable files"] == 1


def _datasets_directory(root: Path, parts: int = 3) -> Path:
    """What datasets' save_to_disk writes, made with pyarrow alone: arrow IPC streams listed by state.json."""
    import pyarrow as pa

    root.mkdir()
    names = [f"data-{i:05d}-of-{parts:05d}.arrow" for i in range(parts)]
    for i, name in enumerate(names):
        table = pa.table({"text": TEXTS[i::parts]})
        with pa.OSFile(str(root / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (root / "dataset_info.json").write_text("{}")
    return root


def test_a_datasets_directory_missing_an_arrow_file_is_refused_before_reading(tmp_path):
    pytest.importorskip("pyarrow")
    corpus = _datasets_directory(tmp_path / "corpus")
    assert prepare_shards(str(corpus), "byte", tmp_path / "whole")["num_documents"] == len(TEXTS)
    (corpus / "data-00001-of-00003.arrow").unlink()
    with pytest.raises(ValueError, match=f"{corpus / 'data-00001-of-00003.arrow'} cannot be read to its end "
                                         r"\(it is missing\)"):
        prepare_shards(str(corpus), "bpe", tmp_path / "out", bpe_vocab_size=300)
    assert _left(tmp_path) == ["whole"]
    meta = prepare_shards(str(corpus), "byte", tmp_path / "out", skip_bad_files=True)
    assert meta["num_documents"] == len(TEXTS) - len(TEXTS[1::3])
    assert meta["skipped_examples"] == {"damaged or unreadable files": "data-00001-of-00003.arrow (missing)"}


def test_a_truncated_arrow_file_is_refused(tmp_path):
    pytest.importorskip("pyarrow")
    corpus = _datasets_directory(tmp_path / "corpus")
    data = (corpus / "data-00002-of-00003.arrow").read_bytes()
    (corpus / "data-00002-of-00003.arrow").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="data-00002-of-00003.arrow cannot be read to its end"):
        prepare_shards(str(corpus), "byte", tmp_path / "out")
    assert _left(tmp_path) == []


def test_a_missing_text_field_is_named_with_the_keys_before_a_bpe_is_trained(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("a text file first\n")
    (tmp_path / "corpus" / "b.jsonl").write_text("".join(json.dumps({"content": t, "id": 1}) + "\n" for t in TEXTS))
    script = [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--source", str(tmp_path / "corpus"),
              "--tokenizer", "bpe", "--bpe-vocab-size", "300", "--out", str(tmp_path / "out")]
    run = run_command(script, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert ("data.text_field='text' is not a key of the first JSON object of b.jsonl:1 (its keys: 'content', 'id'): "
            "pass the key that holds the text as --text-field") in run.stderr
    assert _left(tmp_path) == []


def test_the_script_skips_on_request_and_says_so(tmp_path):
    corpus = _gz_corpus(tmp_path / "corpus", DAMAGES["corrupt"])
    script = [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--source", str(corpus), "--out",
              str(tmp_path / "out")]
    refused = run_command(script, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "b_bad.jsonl.gz cannot be read to its end" in refused.stderr
    done = run_command([*script, "--skip-bad-files"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "skipped 1 damaged or unreadable files (first: b_bad.jsonl.gz" in done.stdout


def test_finished_shards_before_a_damaged_file_are_never_taken_for_a_good_corpus(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()  # over a megabyte before the damage: the encoders' first chunk, so shards finish first
    (corpus / "a_good.jsonl.gz").write_bytes(gzip.compress(_lines(TEXTS * 50)))
    (corpus / "b_bad.jsonl.gz").write_bytes(DAMAGES["truncated"](gzip.compress(_lines(TEXTS))))
    with pytest.raises(ValueError, match="b_bad.jsonl.gz cannot be read to its end"):
        prepare_shards(str(corpus), "byte", tmp_path / "out", shard_tokens=200_000)
    assert _left(tmp_path) == [".out.partial"]  # the shards before the damage, kept for a resume, not as data
    assert not (tmp_path / ".out.partial" / "meta.json").exists()
    (corpus / "b_bad.jsonl.gz").write_bytes(gzip.compress(_lines(TEXTS)))  # a good copy: the corpus changed
    meta = prepare_shards(str(corpus), "byte", tmp_path / "out", shard_tokens=200_000)
    assert meta["num_documents"] == 51 * len(TEXTS) and not meta["skipped"]
    good = tmp_path / "good"
    good.mkdir()
    for name in ("a_good.jsonl.gz", "b_bad.jsonl.gz"):
        (good / name).write_bytes((corpus / name).read_bytes())
    reference = prepare_shards(str(good), "byte", tmp_path / "reference", shard_tokens=200_000)
    assert [s["bin_sha256"] for s in meta["shards"]] == [s["bin_sha256"] for s in reference["shards"]]
