"""The data pipeline: tokenizers, atomic deterministic preparation, and batches that are a pure function of
(seed, step) whose union over data-parallel ranks is the same global batch for every layout."""

from __future__ import annotations

import hashlib
import json
import sys
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from parallel_attention.training import DataConfig
from parallel_attention.training import (GlobalBatchSampler, ensure_prepared, prepare_data, read_meta,
                                         validation_batches)
from parallel_attention.training.data.read.token_source import open_source
from launch import ROOT, run_command
from parallel_attention.training import ByteTokenizer, TokenizerUnavailableError, get_tokenizer
from parallel_attention.training.data.indexed_dataset import IndexedTokens
from parallel_attention.training.data.token_files import DataFileError


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def corpus(tmp_path):
    """A small corpus: two .txt files and a .jsonl file of three documents (one non-ASCII), in a subdir too."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("the quick brown fox\n" * 40, encoding="utf-8")
    (root / "sub" / "b.txt").write_text("jumps over the lazy dog\n" * 30, encoding="utf-8")
    lines = [{"text": f"document {i}: " + "héllo wörld " * (20 + i)} for i in range(3)]
    (root / "c.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n", encoding="utf-8")
    (root / "ignored.bin").write_bytes(b"\x00\x01 not a corpus file type")
    return root


@pytest.fixture
def mixed_corpus(tmp_path):
    """Every supported format, with a custom text field, a binary file, a bad JSON line and an empty file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "mixed"
    (root / "code" / ".git").mkdir(parents=True)
    (root / "notes.txt").write_text("plain text file\n", encoding="utf-8")
    (root / "README.md").write_text("# Title\n\nmarkdown ✓\n", encoding="utf-8")
    (root / "code" / "mod.py").write_text("def f():\n    return 1\n", encoding="utf-8")
    (root / "code" / ".git" / "HEAD").write_text("hidden: never read", encoding="utf-8")
    (root / "binary.txt").write_bytes(bytes(range(256)))  # a text suffix, binary content: skipped
    (root / "empty.md").write_text("", encoding="utf-8")
    lines = [json.dumps({"content": "line one"}), "{not json", json.dumps({"text": "wrong field"}),
             json.dumps({"content": "line two"})]
    (root / "rows.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    pq.write_table(pa.table({"content": ["row one", "row two", "row three"], "n": [1, 2, 3]}), root / "t.parquet")
    return root


MIXED_DOCUMENTS = {"plain text file\n", "# Title\n\nmarkdown ✓\n", "def f():\n    return 1\n", "line one",
                   "line two", "row one", "row two", "row three"}


def test_byte_tokenizer_round_trip():
    tok = get_tokenizer("byte")
    text = "déjà vu — ünïcode ✓ and ascii"
    ids = tok.encode(text)
    assert (tok.vocab_size, tok.eot_token) == (256, 0)
    assert all(0 < i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode_array(text).tolist() == ids
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"  # invalid UTF-8 is replaced, not raised


def test_unknown_tokenizer_names_the_choices():
    with pytest.raises(ValueError, match="byte"):
        get_tokenizer("sentencepiece")


def _shard_documents(out: Path, meta: dict) -> list[np.ndarray]:
    """Every document of every shard, in order, each checked to end with the end-of-text token."""
    docs = []
    for shard in meta["shards"]:
        tokens = IndexedTokens(out / shard["prefix"])
        docs += [tokens.document(i) for i in range(tokens.num_documents)]
    assert all(doc[-1] == meta["eot_token"] and meta["eot_token"] not in doc[:-1] for doc in docs)
    return docs


def test_prepare_writes_little_endian_uint16_shards_with_checksums(corpus, tmp_path):
    out = tmp_path / "out"
    meta = prepare_data(str(corpus), "byte", out, val_fraction=0.3)
    assert meta == json.loads((out / "meta.json").read_text())
    assert (meta["dtype"], meta["vocab_size"], meta["eot_token"], meta["tokenizer"]) == ("uint16", 256, 0, "byte")
    assert (meta["num_files"], meta["num_documents"]) == (3, 5)
    assert meta["skipped"] == {"files of another type": 1} and meta["skipped_examples"]["files of another type"] \
        == "ignored.bin"
    for shard in meta["shards"]:
        path = out / f"{shard['prefix']}.bin"
        assert path.stat().st_size == 2 * shard["num_tokens"] > 0
        assert shard["bin_sha256"] == _sha256(path) and shard["idx_sha256"] == _sha256(path.with_suffix(".idx"))
    assert np.array_equal(np.fromfile(out / "shard_00000.bin", dtype="<u2"), IndexedTokens(out / "shard_00000").tokens)
    # Every document ends in eot, and the shards hold exactly the corpus's documents.
    docs = [ByteTokenizer().decode(doc[:-1].tolist()) for doc in _shard_documents(out, meta)]
    assert len(docs) == 5 and sorted(docs)[0].startswith("document 0: héllo")
    assert not list(out.glob(".*tmp*"))


def test_prepare_is_deterministic(corpus, tmp_path):
    first = prepare_data(str(corpus), "byte", tmp_path / "one", val_fraction=0.3)
    second = prepare_data(str(corpus), "byte", tmp_path / "two", val_fraction=0.3)
    for name in ("shard_00000.bin", "shard_00000.idx"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert first == second


def test_max_bytes_caps_the_text_read(corpus, tmp_path):
    meta = prepare_data(str(corpus), "byte", tmp_path / "out", val_fraction=0.3, max_bytes=1000)
    assert meta["num_bytes"] == 1000
    assert meta["num_train_tokens"] + meta["num_val_tokens"] == 1000 + meta["num_documents"]  # + one eot each


def test_single_file_source_is_split_by_tokens(corpus, tmp_path):
    meta = prepare_data(str(corpus / "a.txt"), "byte", tmp_path / "out", val_fraction=0.1)
    assert meta["num_documents"] == 1
    assert meta["num_val_tokens"] == round(0.1 * (len("the quick brown fox\n") * 40 + 1))


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_ensure_prepared_reuses_complete_data_and_refuses_what_it_did_not_prepare(corpus, tmp_path):
    cfg = DataConfig(source=str(corpus), tokenizer="byte", data_dir=str(tmp_path / "out"), val_fraction=0.3,
                     max_bytes=None)
    meta = ensure_prepared(cfg)  # does not exist yet: prepared
    out = tmp_path / "out"
    stamp = (out / "shard_00000.bin").stat().st_mtime_ns
    assert ensure_prepared(cfg) == meta and (out / "shard_00000.bin").stat().st_mtime_ns == stamp  # reused
    assert ensure_prepared(replace(cfg, bpe_vocab_size=300)) == meta  # a setting the byte tokenizer does not use

    # Other settings: refused before anything is written, naming the key, both values and the fix.
    before = _tree(out)
    for change, key, values in [({"max_bytes": 500}, "max_bytes", ("None", "500")),
                                ({"text_field": "body"}, "text_field", ("'text'", "'body'")),
                                ({"source": str(corpus / "sub")}, "source", (repr(str(corpus.resolve())),
                                                                   repr(str((corpus / "sub").resolve())))),
                                ({"tokenizer": "bpe", "bpe_vocab_size": 300}, "tokenizer", ("'byte'", "'bpe'"))]:
        with pytest.raises(DataFileError) as info:
            ensure_prepared(replace(cfg, **change))
        message = str(info.value)
        assert f"data.{key}={values[0]}" in message and f"data.{key}={values[1]}" in message, message
        assert "point data.data_dir at another directory" in message and f"delete {out}" in message
    assert _tree(out) == before

    # Damaged or foreign contents: refused too, never prepared over.
    (out / "meta.json").unlink()
    with pytest.raises(DataFileError, match="holds no complete prepared data \\(meta.json missing\\)"):
        ensure_prepared(cfg)
    assert "meta.json" not in _tree(out) and len(_tree(out)) == len(before) - 1

    # An empty directory is prepared, like one that does not exist.
    empty = replace(cfg, data_dir=str(tmp_path / "empty"))
    (tmp_path / "empty").mkdir()
    assert ensure_prepared(empty) == meta


def test_a_directory_of_every_format_gives_one_document_per_file_line_and_row(mixed_corpus, tmp_path):
    meta = prepare_data(str(mixed_corpus), "byte", tmp_path / "out", val_fraction=0.3, text_field="content")
    assert (meta["num_files"], meta["num_documents"]) == (5, len(MIXED_DOCUMENTS))
    assert meta["skipped"] == {"bad JSON lines": 2, "binary or not UTF-8 files": 1, "empty files": 1}
    assert meta["skipped_examples"]["binary or not UTF-8 files"] == "binary.txt"
    assert meta["skipped_examples"]["bad JSON lines"].startswith("rows.jsonl:2")
    found = [ByteTokenizer().decode(doc[:-1].tolist()) for doc in _shard_documents(tmp_path / "out", meta)]
    assert sorted(found) == sorted(MIXED_DOCUMENTS)


def test_a_bad_source_or_text_field_is_named(mixed_corpus, tmp_path):
    with pytest.raises(ValueError, match="data.source='nowhere'"):
        prepare_data("nowhere", "byte", tmp_path / "out")
    with pytest.raises(ValueError, match=r"text_field='nope' is not a key of the first JSON object of rows.jsonl:1 "
                                         r"\(its keys: 'content'\)"):  # a .jsonl is refused at its first object
        prepare_data(str(mixed_corpus), "byte", tmp_path / "out", val_fraction=0.3, text_field="nope")
    (mixed_corpus / "rows.jsonl").unlink()
    meta = prepare_data(str(mixed_corpus), "byte", tmp_path / "out", val_fraction=0.3, text_field="nope")
    assert meta["skipped"]["parquet files without the text column"] == 1  # a parquet file is skipped, counted
    assert "columns: content, n" in meta["skipped_examples"]["parquet files without the text column"]
    assert meta["num_documents"] == 3  # the three text files


def test_the_script_prints_the_summary(mixed_corpus, tmp_path):
    out = run_command([sys.executable, "scripts/prepare_data.py", "--source", str(mixed_corpus), "--out",
                       str(tmp_path / "out"), "--text-field", "content", "--val-fraction", "0.3"],
                      capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
    assert "5 files, 8 documents" in out.stdout
    assert "skipped 2 bad JSON lines (first: rows.jsonl:2" in out.stdout
    assert "skipped 1 binary or not UTF-8 files (first: binary.txt)" in out.stdout


def test_stdlib_source_yields_train_and_val(tmp_path):
    meta = prepare_data("stdlib", "byte", tmp_path / "std", val_fraction=0.02, max_bytes=200_000)
    assert meta["num_bytes"] == 200_000
    assert meta["num_train_tokens"] > 0 and meta["num_val_tokens"] > 0
    assert open_source(str(tmp_path / "std"), 0.02, (256, "byte")).val.num_tokens == meta["num_val_tokens"]


@pytest.fixture
def source(corpus, tmp_path):
    prepare_data(str(corpus), "byte", tmp_path / "out", val_fraction=0.3)
    return open_source(str(tmp_path / "out"), 0.3, (256, "byte"))


def test_token_files_are_read_only_memmaps(source):
    tokens, _ = source.train.shards[0]
    assert source.vocab_size == 256 and source.train.num_tokens > 0
    with pytest.raises((ValueError, TypeError)):
        tokens[0] = 1


def test_global_batch_is_a_pure_function_of_seed_and_step(source):
    sampler = GlobalBatchSampler([source], [1.0], seq_len=16, global_batch_size=8, seed=7)
    again = GlobalBatchSampler([source], [1.0], seq_len=16, global_batch_size=8, seed=7)
    batch = sampler.global_batch(3)
    assert batch.shape == (8, 17) and batch.dtype == torch.long
    sampler.global_batch(4)  # drawing other steps in between changes nothing: no hidden state
    assert torch.equal(again.global_batch(3), batch)
    assert not torch.equal(sampler.global_batch(4), batch)
    assert not torch.equal(GlobalBatchSampler([source], [1.0], 16, 8, seed=8).global_batch(3), batch)
    # Each row is a contiguous window of the token stream.
    start = int(sampler.rows(3).offset[0])
    assert batch[0].tolist() == source.train.windows([start], 17)[0].tolist()


@pytest.mark.parametrize("dp_size", [1, 2, 4])
@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_union_over_dp_ranks_is_the_global_batch(source, dp_size, micro_batch_size):
    sampler = GlobalBatchSampler([source], [1.0], seq_len=16, global_batch_size=8, seed=1234)
    for step in (0, 5):
        tokens, labels = [], []
        for dp_rank in range(dp_size):
            micro = sampler.local_micro_batches(step, dp_rank, dp_size, micro_batch_size)
            assert len(micro) == 8 // dp_size // micro_batch_size
            for t, lab in micro:
                assert t.shape == lab.shape == (micro_batch_size, 16)
                assert torch.equal(t[:, 1:], lab[:, :-1])  # labels are the tokens shifted by one
                tokens.append(t)
                labels.append(lab)
        full = sampler.global_batch(step)
        assert torch.equal(torch.cat(tokens), full[:, :-1])
        assert torch.equal(torch.cat(labels), full[:, 1:])


def test_local_micro_batches_rejects_uneven_layouts(source):
    sampler = GlobalBatchSampler([source], [1.0], seq_len=16, global_batch_size=8, seed=0)
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        sampler.local_micro_batches(0, 0, 2, 3)
    with pytest.raises(ValueError, match="dp_rank=2"):
        sampler.local_micro_batches(0, 2, 2, 1)


def test_sequence_longer_than_split_is_a_clear_error(source):
    with pytest.raises(ValueError, match="seq_len"):
        GlobalBatchSampler([source], [1.0], seq_len=source.train.num_tokens, global_batch_size=2, seed=0)


def test_validation_batches_are_fixed_and_split_over_dp(source):
    batches = validation_batches([source], [1.0], seq_len=16, batch_size=4, num_batches=3)
    assert len(batches) == 3 and all(t.shape == lab.shape == (4, 16) for t, lab in batches)
    again = validation_batches([source], [1.0], seq_len=16, batch_size=4, num_batches=3)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    halves = [validation_batches([source], [1.0], 16, 4, 3, dp_rank=r, dp_size=2) for r in range(2)]
    for b, (tokens, labels) in enumerate(batches):
        assert torch.equal(torch.cat([halves[0][b][0], halves[1][b][0]]), tokens)
        assert torch.equal(torch.cat([halves[0][b][1], halves[1][b][1]]), labels)


def test_gpt2_without_tiktoken_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` raise ImportError
    with pytest.raises(TokenizerUnavailableError, match="pip install tiktoken"):
        get_tokenizer("gpt2")


def test_gpt2_without_cached_files_refuses_to_download(monkeypatch, tmp_path):
    fake = types.ModuleType("tiktoken")
    fake.get_encoding = lambda name: pytest.fail("tiktoken.get_encoding would download the BPE files")
    monkeypatch.setitem(sys.modules, "tiktoken", fake)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(TokenizerUnavailableError, match="vocab.bpe, encoder.json.*TIKTOKEN_CACHE_DIR"):
        get_tokenizer("gpt2")
    # A corrupt cached file would make tiktoken re-download it: refused as well.
    for url in ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"):
        (tmp_path / hashlib.sha1(url.encode()).hexdigest()).write_bytes(b"truncated")
    with pytest.raises(TokenizerUnavailableError, match="checksum"):
        get_tokenizer("gpt2")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken's switch for "no cache": it would download
    with pytest.raises(TokenizerUnavailableError, match="disables"):
        get_tokenizer("gpt2")


def _gpt2_available() -> bool:
    try:
        get_tokenizer("gpt2")
    except TokenizerUnavailableError:
        return False
    return True


@pytest.mark.skipif(not _gpt2_available(), reason="tiktoken or its cached gpt2 BPE files are not on this machine")
def test_gpt2_round_trip_and_uint16_files(corpus, tmp_path):
    tok = get_tokenizer("gpt2")
    assert (tok.vocab_size, tok.eot_token) == (50257, 50256)
    text = "Hello world <|endoftext|> héllo"
    assert tok.decode(tok.encode(text)) == text
    meta = prepare_data(str(corpus), "gpt2", tmp_path / "g", val_fraction=0.3)
    assert meta["dtype"] == "uint16" and meta["eot_token"] == 50256


def test_a_failed_preparation_leaves_the_existing_dataset_intact(tmp_path):
    good, bad, out = tmp_path / "good", tmp_path / "bad", tmp_path / "prepared"
    good.mkdir(), bad.mkdir()
    (good / "a.txt").write_text("some text to train on. " * 50)
    (bad / "blob.bin").write_bytes(bytes(range(256)) * 8)  # binary only: nothing usable
    meta = prepare_data(str(good), "byte", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match="holds no usable text.*skipped 1"):
        prepare_data(str(bad), "byte", out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and read_meta(out) == meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "good", "prepared"]  # no staging left behind


def test_prepare_data_script_reports_an_empty_source_in_one_line(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "blob.bin").write_bytes(b"\x00\xff" * 100)
    result = run_command([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--source", str(tmp_path / "src"),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr
