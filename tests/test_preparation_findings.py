"""What a new user found preparing real corpora (issue 39 item 5): a refusal's fix reproduces how the source was
prepared, prepare_data.py reads a corpus of one's own whole unless told otherwise, and sizes compare text with text
(a .jsonl.gz's compressed bytes are never taken for its text)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
import shlex
import sys

import pytest

from launch import ROOT, run_command
from parallel_attention.training.data.prepare.shards import prepare_shards
from parallel_attention.training.tokenizer import TokenizerIdentity
from parallel_attention.training.data.token_files import DataFileError, verify_files

TEXTS = [f"record {i}: " + "a few words of text " * (3 + i % 17) for i in range(3000)]


def _script():
    spec = importlib.util.spec_from_file_location("prepare_data_script", ROOT / "scripts" / "prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_data_reads_a_corpus_whole_and_caps_only_stdlib_by_default():
    parse = _script()._parse_args
    assert parse(["--source", "path/to/corpus"]).max_bytes is None
    assert parse([]).max_bytes == parse(["--source", "stdlib"]).max_bytes == 8_000_000  # the quick start's cap
    assert parse(["--source", "path/to/corpus", "--max-bytes", "1000"]).max_bytes == 1000
    assert parse(["--source", "stdlib", "--max-bytes", "none"]).max_bytes is None


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_the_refusal_of_a_changed_shard_prints_the_command_that_prepares_it_again(tmp_path, tokenizer):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "part.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS[:400]))
    out = tmp_path / "data"
    meta = prepare_shards(str(tmp_path / "corpus"), tokenizer, out, val_fraction=0.05, max_bytes=40_000,
                          text_field="body", bpe_vocab_size=300, shard_tokens=5000)
    assert meta["truncated"] and len(meta["shards"]) > 1
    before = {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")}
    shard = out / "shard_00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1  # the same size, another token
    shard.write_bytes(bytes(data))
    with pytest.raises(DataFileError) as info:
        verify_files(out, meta, TokenizerIdentity.from_meta(meta).data_dir_files())
    command = re.search(r"run `([^`]*)`", str(info.value)).group(1)
    args = shlex.split(command)
    assert args[:2] == ["python", "scripts/prepare_data.py"] and args[-2:] == ["--out", str(out)]
    for flag in ("--text-field body", "--max-bytes 40000", "--val-fraction 0.05", "--shard-tokens 5000"):
        assert flag in command, command
    assert ("--bpe-vocab-size 300" in command) == (tokenizer == "bpe")
    run = run_command([sys.executable, *args[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    after = {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")}
    assert after == before  # run as printed, it gives back the very data, BPE included


def test_a_cut_jsonl_gz_compares_text_with_text(tmp_path, capfd):
    (tmp_path / "corpus").mkdir()
    rng = random.Random(0)  # text that compresses about as web text does, in a file of many gzip read blocks
    texts = [" ".join(rng.randbytes(4).hex() for _ in range(rng.randrange(10, 60))) for _ in range(20000)]
    lines = "".join(json.dumps({"text": t, "meta": {"url": f"https://example.org/{i}"}}) + "\n"
                    for i, t in enumerate(texts))
    (tmp_path / "corpus" / "part.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    text_bytes = sum(len(t.encode()) for t in texts)
    capfd.readouterr()
    meta = prepare_shards(str(tmp_path / "corpus"), "byte", tmp_path / "out", max_bytes=text_bytes // 3)
    line = next(x for x in capfd.readouterr().err.splitlines() if "cut the corpus" in x)
    disk = (tmp_path / "corpus" / "part.jsonl.gz").stat().st_size
    assert meta["num_bytes"] == text_bytes // 3
    assert f"read {text_bytes // 3 / 1e6:.1f} MB of text from the first " in line
    assert f"of its {disk / 1e6:.1f} MB on disk" in line
    estimate = float(re.search(r"holds about ([\d.]+) MB of text", line).group(1)) * 1e6
    assert abs(estimate - text_bytes) < 0.15 * text_bytes, (line, text_bytes)
