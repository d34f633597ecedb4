"""Streaming, sharded, resumable preparation (format 2): shards of Megatron-LM's indexed format that hold the corpus's
documents encoded plus end-of-text, byte-identical whatever the worker count and across a kill and a resume;
.jsonl.gz and `datasets` directories as sources; a truncating max_bytes said in one line."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from launch import ROOT, run_command
from parallel_attention.training import ByteTokenizer, DataConfig, ensure_prepared, get_tokenizer, train_bpe
from parallel_attention.training.data.prepare import run_data_dir as data
from parallel_attention.training.data.indexed_dataset import IndexedTokens
from parallel_attention.training.data.prepare.partial_output import PartialPreparation, PreparationInUseError
from parallel_attention.training.data.prepare.shards import prepare_shards
from parallel_attention.training.tokenizer import TokenizerIdentity
from parallel_attention.training.data.token_files import DataFileError, meta_and_reason, verify_files

DOCUMENTS = [f"document {i}: " + "héllo wörld " * (3 + i % 11) + "\n" * (i % 2) for i in range(60)]


@pytest.fixture
def jsonl(tmp_path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS[:40]), encoding="utf-8")
    (root / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS[40:]), encoding="utf-8")
    return root


def _documents(out: Path, meta: dict, decode) -> list[str]:
    """Every document of every shard, decoded, after checking that each ends with end-of-text."""
    found = []
    for shard in meta["shards"]:
        tokens = IndexedTokens(out / shard["prefix"])
        assert (tokens.num_documents, tokens.num_tokens) == (shard["num_documents"], shard["num_tokens"])
        for i in range(tokens.num_documents):
            doc = tokens.document(i)
            assert doc[-1] == meta["eot_token"] and meta["eot_token"] not in doc[:-1]
            found.append(decode(doc[:-1].tolist()))
    return found


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if not p.name.startswith(".")}


def test_byte_shards_hold_the_documents_and_close_at_shard_tokens(jsonl, tmp_path):
    out = tmp_path / "out"
    meta = prepare_shards(str(jsonl), "byte", out, val_fraction=0.1, shard_tokens=300)
    assert meta == json.loads((out / "meta.json").read_text()) and meta_and_reason(out) == (meta, "")
    assert (meta["format"], meta["format_version"], meta["dtype"], meta["eot_token"]) == ("indexed", 2, "uint16", 0)
    assert _documents(out, meta, ByteTokenizer().decode) == DOCUMENTS
    assert len(meta["shards"]) > 3 and all(s["num_tokens"] >= 300 for s in meta["shards"][:-1])
    assert [s["prefix"] for s in meta["shards"]] == [f"shard_{i:05d}" for i in range(len(meta["shards"]))]
    encoded = [len(d.encode("utf-8")) + 1 for d in DOCUMENTS]
    assert meta["num_tokens"] == sum(encoded) == meta["num_train_tokens"] + meta["num_val_tokens"]
    assert (meta["num_documents"], meta["num_val_documents"], meta["num_train_documents"]) == (60, 6, 54)
    assert meta["num_val_tokens"] == sum(encoded[9::10])  # validation_mask: every tenth document
    verify_files(out, meta, TokenizerIdentity.from_meta(meta).data_dir_files())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"]  # no partial or lock left behind


def test_bpe_shards_are_identical_for_any_worker_count(jsonl, tmp_path):
    metas = [prepare_shards(str(jsonl), "bpe", tmp_path / f"w{w}", bpe_vocab_size=300, num_workers=w,
                            shard_tokens=200) for w in (1, 2)]
    assert metas[0] == metas[1] and _files(tmp_path / "w1") == _files(tmp_path / "w2")
    tok = get_tokenizer("bpe", tmp_path / "w1")
    assert metas[0]["tokenizer_sha256"] and _documents(tmp_path / "w1", metas[0], tok.decode) == DOCUMENTS


KILLED_RUN = """
import os, signal, sys
from parallel_attention.training.data import indexed_dataset
from parallel_attention.training.data.prepare.shards import prepare_shards

calls, add = [0], indexed_dataset.IndexedDatasetWriter.add_document
def add_then_die(self, tokens):  # SIGKILL midway through the third shard: two finished, one half-written
    add(self, tokens)
    calls[0] += 1
    if calls[0] == int(sys.argv[3]):
        self._bin.flush()
        os.kill(os.getpid(), signal.SIGKILL)
indexed_dataset.IndexedDatasetWriter.add_document = add_then_die
if __name__ == "__main__":
    prepare_shards(sys.argv[1], "bpe", sys.argv[2], bpe_vocab_size=300, num_workers=2, shard_tokens=150)
"""


def test_a_killed_preparation_resumes_byte_identical(jsonl, tmp_path, capfd):
    whole = prepare_shards(str(jsonl), "bpe", tmp_path / "whole", bpe_vocab_size=300, num_workers=2,
                           shard_tokens=150)
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED_RUN))
    die_at = whole["shards"][0]["num_documents"] + whole["shards"][1]["num_documents"] + 2
    run = run_command([sys.executable, str(script), str(jsonl), str(tmp_path / "out"), str(die_at)],
                      capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == -9, run.stderr
    partial = tmp_path / ".out.partial"
    assert not (tmp_path / "out").exists() and (partial / "shard_00001.idx").is_file()
    assert (partial / "shard_00002.bin.tmp").is_file() and not (partial / "shard_00002.idx").exists()
    capfd.readouterr()
    resumed = prepare_shards(str(jsonl), "bpe", tmp_path / "out", bpe_vocab_size=300, num_workers=1,
                             shard_tokens=150)
    err = capfd.readouterr().err
    assert "resuming the preparation of" in err and "from its 2 finished shards" in err
    assert "training a byte-level BPE" not in err  # the BPE of the killed run is reused
    assert resumed == whole and _files(tmp_path / "out") == _files(tmp_path / "whole")
    assert not partial.exists()


def test_a_resume_with_other_settings_starts_over(jsonl, tmp_path, capfd):
    settings = {"shard_tokens": 1}
    with pytest.raises(KeyboardInterrupt):
        with PartialPreparation(tmp_path / "out", settings) as partial:
            (partial.path / "tokenizer.json").write_text("{}")  # finished work: kept for a resume
            raise KeyboardInterrupt
    assert "run the same command again to resume" in capfd.readouterr().err
    meta = prepare_shards(str(jsonl), "byte", tmp_path / "out", shard_tokens=10_000)
    assert "starting the preparation of" in capfd.readouterr().err and len(meta["shards"]) == 1
    assert _documents(tmp_path / "out", meta, ByteTokenizer().decode) == DOCUMENTS


def test_a_second_preparation_of_the_same_directory_is_refused(jsonl, tmp_path):
    with PartialPreparation(tmp_path / "out", {}):
        with pytest.raises(PreparationInUseError, match=f"pid [0-9]+ .*{tmp_path / '.out.lock'}"):
            prepare_shards(str(jsonl), "byte", tmp_path / "out")
    prepare_shards(str(jsonl), "byte", tmp_path / "out")  # released: prepared


def test_a_failed_preparation_leaves_the_existing_dataset_intact(jsonl, tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "blob.bin").write_bytes(bytes(range(256)))
    prepare_shards(str(jsonl), "byte", tmp_path / "out")
    before = _files(tmp_path / "out")
    with pytest.raises(ValueError, match="holds no usable text"):
        prepare_shards(str(tmp_path / "bad"), "byte", tmp_path / "out", overwrite=True)
    assert _files(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "corpus", "out"]


def test_out_onto_a_dataset_of_another_source_or_tokenizer_is_refused_unless_overwrite(jsonl, tmp_path):
    """A typo in --out must not destroy hours of preparation: the dataset, its index cache included, stays byte
    for byte; the same source and tokenizer prepare again (other settings), and --overwrite replaces."""
    prepare_shards(str(jsonl), "byte", tmp_path / "out")
    (tmp_path / "out" / ".index_cache").mkdir()
    (tmp_path / "out" / ".index_cache" / "info.json").write_text("{}")
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text("another corpus\n")
    before = _tree(tmp_path / "out")
    with pytest.raises(ValueError, match=f"holds a dataset prepared from '{jsonl.resolve()}' with the tokenizer "
                                         f"byte .* this preparation is of '{other.resolve()}' with byte.*--overwrite"):
        prepare_shards(str(other), "byte", tmp_path / "out")
    train_bpe(iter(DOCUMENTS), 300, tmp_path / "tok" / "tokenizer.json")
    with pytest.raises(ValueError, match=f"with the tokenizer byte .* with {tmp_path / 'tok' / 'tokenizer.json'}"):
        prepare_shards(str(jsonl), str(tmp_path / "tok"), tmp_path / "out")
    script = [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--source", str(other), "--out",
              str(tmp_path / "out")]
    refused = run_command(script, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--overwrite" in refused.stderr and _tree(tmp_path / "out") == before
    assert prepare_shards(str(jsonl), "byte", tmp_path / "out", shard_tokens=500)["shard_tokens"] == 500
    done = run_command([*script, "--overwrite"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["source"] == str(other.resolve())
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a dataset")
    with pytest.raises(ValueError, match="holds files but no prepared dataset"):
        prepare_shards(str(jsonl), "byte", tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "not a dataset"


def test_a_single_document_is_split_by_tokens_and_says_so(tmp_path):
    (tmp_path / "one.txt").write_text("x" * 99, encoding="utf-8")
    meta = prepare_shards(str(tmp_path / "one.txt"), "byte", tmp_path / "out", val_fraction=0.1)
    assert (meta["num_val_tokens"], meta["num_train_tokens"]) == (10, 90) and "single document" in meta["val_split"]


def test_jsonl_gz_gives_one_document_per_line(tmp_path):
    (tmp_path / "c").mkdir()
    with gzip.open(tmp_path / "c" / "part.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"body": d}) + "\n" for d in DOCUMENTS)
    meta = prepare_shards(str(tmp_path / "c"), "byte", tmp_path / "out", text_field="body")
    assert meta["num_files"] == 1 and _documents(tmp_path / "out", meta, ByteTokenizer().decode) == DOCUMENTS


def test_a_datasets_save_to_disk_directory_gives_one_document_per_row(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"content": DOCUMENTS, "id": list(range(60))}).save_to_disk(
        tmp_path / "ds", num_shards=3)
    meta = prepare_shards(str(tmp_path / "ds"), "byte", tmp_path / "out", text_field="content", shard_tokens=500)
    assert meta["num_files"] == 3 and _documents(tmp_path / "out", meta, ByteTokenizer().decode) == DOCUMENTS
    with pytest.raises(ValueError, match="text_field='text'.*columns: content, id"):
        prepare_shards(str(tmp_path / "ds"), "byte", tmp_path / "out2")


def test_a_truncating_max_bytes_says_so_in_one_line(jsonl, tmp_path, capfd):
    capfd.readouterr()
    meta = prepare_shards(str(jsonl), "byte", tmp_path / "cut", max_bytes=500)
    lines = [line for line in capfd.readouterr().err.splitlines() if "cut the corpus" in line]
    assert meta["truncated"] and meta["num_bytes"] == 500 and len(lines) == 1
    assert lines[0].startswith("data.max_bytes=500 cut the corpus: read 0.0 MB of text from the first ") and \
        "--max-bytes none (in a config: data.max_bytes: null)" in lines[0]
    assert not prepare_shards(str(jsonl), "byte", tmp_path / "all", max_bytes=10**9)["truncated"]
    assert "cut the corpus" not in capfd.readouterr().err


def test_a_changed_shard_is_refused_naming_the_file_and_both_hashes(jsonl, tmp_path):
    meta = prepare_shards(str(jsonl), "byte", tmp_path / "out", shard_tokens=300)
    idx = tmp_path / "out" / "shard_00001.idx"
    data = bytearray(idx.read_bytes())
    data[-1] ^= 1
    idx.write_bytes(bytes(data))
    with pytest.raises(DataFileError, match=f"{idx} has sha256 [0-9a-f]{{64}} but .* records "
                                            f"{meta['shards'][1]['idx_sha256']}"):
        verify_files(tmp_path / "out", meta, TokenizerIdentity.from_meta(meta).data_dir_files())


def test_the_script_takes_shard_tokens_and_lists_the_shards(jsonl, tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("prepare_data_script", ROOT / "scripts" / "prepare_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "prepare_data", prepare_shards)  # until prepare_data writes format 2 itself
    tok = train_bpe(iter(DOCUMENTS), 300, tmp_path / "tok" / "tokenizer.json")
    assert script.main(["--source", str(jsonl), "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "out"),
                        "--shard-tokens", "400"]) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    out = capsys.readouterr().out
    assert f"  {len(meta['shards'])} shards:" in out and "    shard_00000.bin/.idx  " in out
    assert meta["shard_tokens"] == 400 and _documents(tmp_path / "out", meta, tok.decode) == DOCUMENTS


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_ensure_prepared_uses_format_2_and_refuses_other_data_leaving_it_byte_identical(jsonl, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setattr(data, "prepare_data", prepare_shards)  # until prepare_data writes format 2 itself
    train_bpe(iter(DOCUMENTS), 300, tmp_path / "tok" / "tokenizer.json")
    cfg = DataConfig(source=str(jsonl), tokenizer=str(tmp_path / "tok"), data_dir=str(tmp_path / "out"),
                     max_bytes=None, shard_tokens=300, num_workers=1)
    meta = ensure_prepared(cfg)
    assert meta["format_version"] == 2 and len(meta["shards"]) > 1
    assert ensure_prepared(replace(cfg, val_fraction=0.5)) == meta  # the reader splits: not a preparation setting
    before = _tree(tmp_path / "out")
    with pytest.raises(DataFileError, match=f"data.source='{jsonl.resolve()}', but the config gives data.source="):
        ensure_prepared(replace(cfg, source=str(tmp_path / "tok")))
    with pytest.raises(DataFileError, match="data.tokenizer='byte'"):
        ensure_prepared(replace(cfg, tokenizer="byte"))
    train_bpe(iter(DOCUMENTS[:30]), 290, tmp_path / "tok" / "tokenizer.json")  # the same path, another tokenizer
    with pytest.raises(DataFileError, match="the tokenizer changed since the data was prepared"):
        ensure_prepared(cfg)
    assert _tree(tmp_path / "out") == before


def test_ensure_prepared_resumes_an_unfinished_preparation(jsonl, tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(data, "prepare_data", prepare_shards)
    cfg = DataConfig(source=str(jsonl), tokenizer="byte", data_dir=str(tmp_path / "out"), max_bytes=None,
                     shard_tokens=300)
    whole = prepare_shards(str(jsonl), "byte", tmp_path / "whole", shard_tokens=300)
    real = PartialPreparation.finish_shard

    def die_after_two(self, writer, *rest):
        real(self, writer, *rest)
        if len(self.shards) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(PartialPreparation, "finish_shard", die_after_two)
    with pytest.raises(KeyboardInterrupt):
        ensure_prepared(cfg)
    monkeypatch.setattr(PartialPreparation, "finish_shard", real)
    assert not (tmp_path / "out").exists() and "kept 2 finished shards" in capfd.readouterr().err
    assert ensure_prepared(cfg) == whole and _files(tmp_path / "out") == _files(tmp_path / "whole")
    assert "from its 2 finished shards" in capfd.readouterr().err


def test_the_fix_for_a_missing_or_truncated_shard_names_the_recorded_settings(jsonl, tmp_path):
    """meta.json is readable even where a shard is gone: the fix command prepares what was prepared."""
    from parallel_attention.training.data.read.token_source import open_source

    prepare_shards(str(jsonl), "byte", tmp_path / "out", max_bytes=4000, shard_tokens=300)
    shard = tmp_path / "out" / "shard_00001.bin"
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(DataFileError) as info:
        open_source(str(tmp_path / "out"), 0.1, (256, "byte"))
    assert (f"--source {jsonl.resolve()} --tokenizer byte --text-field text --max-bytes 4000 --val-fraction 0.02 "
            f"--shard-tokens 300 --out {tmp_path / 'out'}`") in str(info.value)
    (tmp_path / "out" / "meta.json").unlink()
    with pytest.raises(DataFileError, match="prepare_data.py --overwrite --source SOURCE --tokenizer TOKENIZER"):
        open_source(str(tmp_path / "out"), 0.1, (256, "byte"))
