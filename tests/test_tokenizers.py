"""Hugging Face tokenizers offline: a byte-level BPE trained on the corpus, a saved tokenizer.json directory as
data.tokenizer, the vocabulary checked against model.vocab_size, and a short pretraining run with `bpe`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from launch import ROOT, torchrun
from parallel_attention.training.data.read.data_identity import keep_run_tokenizer
from parallel_attention.training.data.read.token_source import open_source
from parallel_attention.training import (ConfigError, DataConfig, HFTokenizer, ensure_prepared, get_tokenizer,
                                         load_config, prepare_data, train_bpe)
from parallel_attention.training.data.indexed_dataset import IndexedTokens

TEXTS = [f"def function_{i}(x):\n    return x * {i} + len('héllo wörld')\n" for i in range(60)]
TEXTS += ["The quick brown fox jumps over the lazy dog. " * 5, "import os\nimport sys\nprint(os.getcwd())\n"]


@pytest.fixture
def jsonl_corpus(tmp_path) -> Path:
    """A directory of .jsonl files whose text sits in the field "body"."""
    root = tmp_path / "jsonl"
    root.mkdir()
    for part in range(2):
        lines = [json.dumps({"body": text, "id": i}) for i, text in enumerate(TEXTS[part::2])]
        (root / f"part{part}.jsonl").write_text("\n".join(lines * 4) + "\n", encoding="utf-8")
    return root


def test_bpe_round_trips_with_its_vocab_size_and_eos(tmp_path):
    tok = train_bpe(iter(TEXTS), 300, tmp_path / "tokenizer.json")
    assert tok.vocab_size == 300
    assert tok.eot_token == 0 and tok._tokenizer.id_to_token(0) == "<|endoftext|>"
    for text in [*TEXTS[:3], "never seen: ✓ 日本語 \t\x01 emoji 🙂"]:  # byte-level: any text encodes exactly
        ids = tok.encode(text)
        assert tok.decode(ids) == text and tok.eot_token not in ids
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0].encode("utf-8"))  # merges were learned
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>"
    train_bpe(iter(TEXTS), 300, tmp_path / "again" / "tokenizer.json")  # the trainer is deterministic
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()


def test_bpe_vocab_too_small_is_named(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=200.*257"):
        train_bpe(iter(TEXTS), 200, tmp_path / "tokenizer.json")


def test_prepare_with_bpe_is_deterministic_for_any_worker_count(jsonl_corpus, tmp_path):
    one = prepare_data(str(jsonl_corpus), "bpe", tmp_path / "one", val_fraction=0.1, text_field="body",
                       bpe_vocab_size=320, num_workers=1)
    two = prepare_data(str(jsonl_corpus), "bpe", tmp_path / "two", val_fraction=0.1, text_field="body",
                       bpe_vocab_size=320, num_workers=2)
    assert one == two and one["tokenizer"] == "bpe" and one["vocab_size"] == 320
    for name in ("tokenizer.json", "shard_00000.bin", "shard_00000.idx"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    tok = get_tokenizer("bpe", tmp_path / "one")
    shard = IndexedTokens(tmp_path / "one" / "shard_00000")
    assert one["num_documents"] == len(TEXTS) * 4 == shard.num_documents
    for i in (0, 1, shard.num_documents - 1):  # every document is its text, then the EOS
        doc = shard.document(i)
        assert doc[-1] == tok.eot_token and tok.eot_token not in doc[:-1]
        assert tok.decode(doc[:-1].tolist()) in TEXTS


def test_bpe_training_is_announced_and_timed(jsonl_corpus, tmp_path, capsys):
    """No silence while the BPE trains: a line before (what, on how much text, where it is kept), one after."""
    prepare_data(str(jsonl_corpus), "bpe", tmp_path / "data", val_fraction=0.1, text_field="body",
                 bpe_vocab_size=300, num_workers=1)
    before, after = capsys.readouterr().err.splitlines()[:2]
    size = sum(f.stat().st_size for f in jsonl_corpus.iterdir()) / 1e6  # bytes on disk, said as such (not text)
    assert before == (f"training a byte-level BPE of 300 tokens on all the text of {jsonl_corpus} ({size:.1f} MB on "
                      f"disk; kept as {tmp_path / 'data' / 'tokenizer.json'}: runs with the same data settings reuse "
                      "it)")
    assert after.startswith("trained the BPE (300 tokens) on ") and f"in {len(TEXTS) * 4} documents in " in after
    assert after.endswith(" s")


def test_a_saved_tokenizer_directory_is_a_tokenizer(jsonl_corpus, tmp_path):
    saved = tmp_path / "my_tokenizer"
    saved.mkdir()
    train_bpe(iter(TEXTS), 280, saved / "tokenizer.json")
    cfg = DataConfig(source=str(jsonl_corpus), tokenizer=str(saved), data_dir=str(tmp_path / "data"),
                     text_field="body", max_bytes=None, num_workers=1)
    meta = ensure_prepared(cfg)
    assert meta["tokenizer"] == str((saved / "tokenizer.json").resolve()) and meta["vocab_size"] == 280
    run_cfg = load_config(None, [f"--data.data_dir={cfg.data_dir}", f"--data.tokenizer={saved}",
                                 f"--logging.run_dir={tmp_path / 'run'}"])
    keep_run_tokenizer(run_cfg, [open_source(cfg.data_dir, 0.02, (280, str(saved)))])  # what a run keeps
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").read_bytes() == (saved / "tokenizer.json").read_bytes()
    assert (tmp_path / "run" / "tokenizer" / "tokenizer_config.json").is_file()
    assert isinstance(get_tokenizer(str(tmp_path / "run" / "tokenizer")), HFTokenizer)
    stamp = (tmp_path / "data" / "shard_00000.bin").stat().st_mtime_ns
    assert ensure_prepared(cfg) == meta and (tmp_path / "data" / "shard_00000.bin").stat().st_mtime_ns == stamp

    # A changed tokenizer file is refused, though its path is the same: the data's ids are the old tokenizer's.
    train_bpe(iter(TEXTS), 290, saved / "tokenizer.json")
    with pytest.raises(ConfigError, match="the tokenizer changed since the data was prepared"):
        ensure_prepared(cfg)


def test_a_tokenizer_without_eos_is_refused_with_the_fix(jsonl_corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="no end-of-text token.*eos_token"):
        prepare_data(str(jsonl_corpus), str(tmp_path), tmp_path / "out", text_field="body", num_workers=1)


@pytest.mark.parametrize("overrides,needles", [
    (["--data.tokenizer=bpe"], ["model.vocab_size=256", "'bpe'", "8192"]),
    (["--data.tokenizer=bpe", "--data.bpe_vocab_size=100"], ["data.bpe_vocab_size=100", "257"]),
    (["--data.tokenizer=sentencepiece"], ["data.tokenizer", "'sentencepiece'", "byte", "bpe", "tokenizer.json"]),
    (["--data.tokenizer=:byte"], ["data.tokenizer", "':byte'"]),  # a YAML slip found by test_properties
    (["--data.num_workers=-1"], ["data.num_workers=-1"]),
])
def test_tokenizer_settings_are_checked_in_validate(overrides, needles):
    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", overrides)
    with pytest.raises(ConfigError) as info:
        cfg.validate(2)
    for needle in needles:
        assert needle in str(info.value)


def test_a_tokenizer_path_is_checked_against_model_vocab_size(tmp_path):
    train_bpe(iter(TEXTS), 300, tmp_path / "tokenizer.json")
    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", [f"--data.tokenizer={tmp_path}"])
    with pytest.raises(ConfigError, match="model.vocab_size=256 is smaller .* 300 tokens"):
        cfg.validate(2)
    load_config(ROOT / "configs" / "gpt_tiny.yaml", [f"--data.tokenizer={tmp_path}", "--model.vocab_size=300"]) \
        .validate(2)


def test_pretraining_with_a_bpe_trained_on_jsonl(jsonl_corpus, tmp_path):
    run = tmp_path / "run"
    args = ["--config", str(ROOT / "configs" / "gpt_tiny.yaml"), "--model.hidden_size=32", "--model.num_layers=2",
            "--model.vocab_size=320", "--model.max_seq_len=16", "--data.seq_len=16", "--training.global_batch_size=4",
            "--training.micro_batch_size=2", "--training.max_steps=3", "--training.eval_interval=5",
            "--training.eval_batches=1", "--schedule.warmup_steps=1", "--logging.log_interval=1",
            "--logging.progress_bar=false", "--logging.tensorboard=false", f"--data.source={jsonl_corpus}",
            "--data.tokenizer=bpe", "--data.bpe_vocab_size=320", "--data.text_field=body", "--data.num_workers=1",
            "--data.max_bytes=null", "--data.val_fraction=0.2", f"--data.data_dir={tmp_path / 'data'}",
            "--parallel.tensor_parallel_size=1", f"--logging.run_dir={run}"]
    torchrun("pretrain.py", 1, args, timeout=240)
    saved = run / "tokenizer" / "tokenizer.json"
    assert saved.read_bytes() == (tmp_path / "data" / "tokenizer.json").read_bytes()
    assert get_tokenizer(str(run / "tokenizer")).vocab_size == 320
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["tokenizer"] == "bpe" and meta["text_field"] == "body"
    losses = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert sorted(r["step"] for r in losses if "loss" in r) == [1, 2, 3]
    assert np.isfinite([r["loss"] for r in losses if "loss" in r]).all()
