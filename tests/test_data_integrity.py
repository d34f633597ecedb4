"""Prepared data that cannot be trained on is refused before any step, naming the file and the fix: a token file
changed after preparation (its sha256), ids outside the vocabulary, an unreadable tokenizer.json; a preparation
that is redone says why, in one line."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from distributed import run_distributed
from launch import ROOT, environment, run_command, torchrun_command
from parallel_attention.training import ConfigError, DataConfig, ensure_prepared, load_config, prepare_data, \
    train_bpe
from parallel_attention.training.data import token_files
from parallel_attention.training.data.token_files import SHA_CACHE, DataFileError, sha256_of
from parallel_attention.training.data.read.token_source import open_source

MAX_BYTES, VAL_FRACTION = 20_000, 0.05


@pytest.fixture
def data_cfg(tmp_path) -> DataConfig:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox\n" * 200, encoding="utf-8")
    (corpus / "b.txt").write_text("jumps over the lazy dog\n" * 200, encoding="utf-8")
    cfg = DataConfig(source=str(corpus), tokenizer="byte", data_dir=str(tmp_path / "data"), val_fraction=0.3,
                     max_bytes=None)
    ensure_prepared(cfg)
    return cfg


def _open(cfg: DataConfig, verify: bool = True):
    return open_source(cfg.data_dir, cfg.val_fraction, (256, "byte"), verify=verify)


def _zero(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def test_a_same_size_zeroed_token_file_is_refused_naming_the_file_and_both_hashes(data_cfg):
    train = Path(data_cfg.data_dir) / "shard_00000.bin"
    recorded = json.loads((train.parent / "meta.json").read_text())["shards"][0]["bin_chunk_sha256"][0]
    _open(data_cfg)  # indexed while intact
    _zero(train)
    source = _open(data_cfg)  # the start reads no .bin: its chunk is verified when first read
    for read_it in (lambda: source.train.windows([0], 8), lambda: _open(data_cfg).val.windows([0], 8)):
        with pytest.raises(DataFileError) as info:
            read_it()
        message = str(info.value)
        assert isinstance(info.value, ConfigError)  # pretrain.py: `config error: ...`, exit 2
        assert str(train) in message and recorded in message and sha256_of(train) in message, message
        assert f"delete {train.parent} and start the run again" in message and "scripts/prepare_data.py" in message
    assert train.read_bytes() == bytes(train.stat().st_size)  # refused, not silently prepared again


def test_the_hash_cache_is_used_only_while_the_file_is_unchanged(data_cfg, monkeypatch):
    train = Path(data_cfg.data_dir) / "shard_00000.bin"
    monkeypatch.setattr(token_files, "_RACY_NS", 0)  # the file was written just now: trust the hash at once
    real = sha256_of(train)
    cache = json.loads((train.parent / SHA_CACHE).read_text())
    cache["shard_00000.bin"]["sha256"] = "f" * 64
    (train.parent / SHA_CACHE).write_text(json.dumps(cache))
    assert sha256_of(train) == "f" * 64  # unchanged (size, mtime, ctime, inode): not read again
    stat = train.stat()
    _zero(train)
    os.utime(train, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime: the ctime still moved
    assert sha256_of(train) not in ("f" * 64, real)


def test_a_hash_taken_right_after_a_write_is_taken_again(data_cfg):
    train = Path(data_cfg.data_dir) / "shard_00000.bin"
    sha256_of(train)
    cache = json.loads((train.parent / SHA_CACHE).read_text())
    cache["shard_00000.bin"]["sha256"] = "f" * 64  # racy: hashed within _RACY_NS of the last write
    (train.parent / SHA_CACHE).write_text(json.dumps(cache))
    assert sha256_of(train) != "f" * 64


def test_a_read_only_data_dir_just_has_no_cache(data_cfg, monkeypatch):
    def refuse(*args):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(token_files.os, "replace", refuse)
    _open(data_cfg)
    assert not list(Path(data_cfg.data_dir).glob(f"*{SHA_CACHE}*"))


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("damage, why", [
    (lambda d: (d / "meta.json").unlink(), "meta.json missing"),
    (lambda d: (d / "meta.json").write_text('{"vocab_size": 2'), "is not a valid meta.json (JSONDecodeError"),
    (lambda d: (d / "shard_00000.bin").write_bytes(b"0123456789"),
     "shard_00000.bin has 10 bytes, meta.json records "),
    (lambda d: (d / "shard_00000.idx").unlink(), "shard_00000.idx missing"),
])
def test_a_damaged_directory_is_refused_naming_why_and_left_as_it_is(data_cfg, capfd, damage, why):
    data_dir = Path(data_cfg.data_dir)
    capfd.readouterr()
    ensure_prepared(data_cfg)
    assert capfd.readouterr().err == ""  # reused: nothing said
    damage(data_dir)
    before = _tree(data_dir)
    with pytest.raises(DataFileError) as info:
        ensure_prepared(data_cfg)
    message = str(info.value)
    assert message.startswith(f"data.data_dir={str(data_dir)!r} holds no complete prepared data (") and why in message
    assert f"delete {data_dir}" in message and "\n" not in message
    assert _tree(data_dir) == before  # never prepared over


def test_changed_settings_or_tokenizer_are_refused_naming_both(data_cfg, tmp_path):
    data_dir = Path(data_cfg.data_dir)
    before = _tree(data_dir)
    with pytest.raises(DataFileError, match="holds data prepared with data.max_bytes=None, but the config gives "
                                            "data.max_bytes=500.*set data.max_bytes=null to train on this data"):
        ensure_prepared(replace(data_cfg, max_bytes=500))
    train_bpe(iter(["hello world " * 40, "abc " * 30]), 300, tmp_path / "tok" / "tokenizer.json")
    path_cfg = replace(data_cfg, tokenizer=str(tmp_path / "tok" / "tokenizer.json"), num_workers=1,
                       data_dir=str(tmp_path / "tok_data"))
    with pytest.raises(DataFileError, match="data.tokenizer='byte', but the config gives data.tokenizer='/"):
        ensure_prepared(replace(path_cfg, data_dir=str(data_dir)))
    assert _tree(data_dir) == before
    meta = ensure_prepared(path_cfg)
    train_bpe(iter(["other text " * 40]), 280, tmp_path / "tok" / "tokenizer.json")  # same path, other tokenizer
    with pytest.raises(DataFileError, match=f"has sha256 [0-9a-f]{{64}}, but .* records {meta['tokenizer_sha256']}: "
                                            "the tokenizer changed since the data was prepared"):
        ensure_prepared(path_cfg)


def test_ids_outside_the_vocabulary_name_the_data_file(data_cfg):
    data_dir = Path(data_cfg.data_dir)
    tokens = np.fromfile(data_dir / "shard_00000.bin", dtype="<u2")
    tokens[5] = 300  # the byte tokenizer has 256
    tokens.tofile(data_dir / "shard_00000.bin")
    stream = _open(data_cfg, verify=False).train  # read past the hashes, as a damaged copy might be
    with pytest.raises(DataFileError, match=f"{data_dir / 'shard_00000.bin'} holds token id 300, outside the "
                                            r"vocabulary \[0, 256\) of the tokenizer byte"):
        stream.windows([0], 16)
    assert stream.windows([6], 16).shape == (1, 16)


@pytest.mark.parametrize("broken", ["tokenizer.json", "tokenizer_config.json"])
def test_an_unreadable_tokenizer_file_is_a_config_error_naming_the_key_and_the_file(tmp_path, broken):
    train_bpe(iter(["hello world " * 40, "abc " * 30]), 300, tmp_path / "tokenizer.json")
    path = tmp_path / broken
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])  # an interrupted copy
    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", [f"--data.tokenizer={tmp_path}", "--model.vocab_size=300"])
    with pytest.raises(ConfigError) as info:
        cfg.validate(2)
    message = str(info.value)
    assert message.startswith("data.tokenizer: tokenizer ") and f"{str(path)!r} cannot be read" in message, message
    assert "EOF while parsing" in message or "JSON" in message, message


def _build_data_on_each_rank(cfg, bad_dir_on_rank_1):
    """build_data's verdict on this rank: the error message, or None."""
    from parallel_attention.tensor_parallel import parallel_state as ps
    from parallel_attention.training.data.read.run_data import build_data

    if bad_dir_on_rank_1 and ps.get_global_rank() == 1:  # rank 1 sees other files than rank 0 (another mount)
        cfg.data.data_dir = bad_dir_on_rank_1
    try:
        build_data(cfg)
    except DataFileError as error:
        return str(error)
    return None


def _pretrain_config(data_dir: Path, run_dir: Path, *extra: str):
    return load_config(ROOT / "configs" / "gpt_tiny.yaml", [
        "--model.max_seq_len=32", "--data.seq_len=32", "--training.global_batch_size=8",
        "--training.micro_batch_size=2", "--training.max_steps=2", "--logging.progress_bar=false",
        "--logging.tensorboard=false", "--parallel.tensor_parallel_size=1", "--data.source=stdlib",
        f"--data.max_bytes={MAX_BYTES}", f"--data.val_fraction={VAL_FRACTION}", f"--data.data_dir={data_dir}",
        f"--logging.run_dir={run_dir}", *extra])


def test_every_rank_refuses_alike_whichever_rank_finds_the_fault(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    for path in (good, bad):
        prepare_data("stdlib", "byte", path, val_fraction=VAL_FRACTION, max_bytes=MAX_BYTES)
    _zero(bad / "shard_00000.idx")  # checked at start, when the index cache is built (a .bin: when read)
    cfg = _pretrain_config(good, tmp_path / "run")
    assert run_distributed(_build_data_on_each_rank, 2, 1, cfg, None) == [None, None]
    said = run_distributed(_build_data_on_each_rank, 2, 1, cfg, str(bad))  # only rank 1 finds it: no hang
    assert said[0] == said[1] and str(bad / "shard_00000.idx") in said[0], said
    said = run_distributed(_build_data_on_each_rank, 2, 1, _pretrain_config(bad, tmp_path / "run"), None)
    assert said[0] == said[1] and str(bad / "shard_00000.idx") in said[0], said  # rank 0 found it first


def _build_data_as_node(cfg, nodes: str):
    """build_data on this rank as node (global rank) of a job whose nodes each hold their own copy of the data:
    the same relative blend path, read from the node's own directory. The error message, or None."""
    from parallel_attention.tensor_parallel import parallel_state as ps

    where, rank = os.getcwd(), ps.get_global_rank()
    os.environ["GROUP_RANK"] = str(rank)
    os.chdir(Path(nodes) / f"node{rank}")
    try:
        return _build_data_on_each_rank(cfg, None)
    finally:
        os.chdir(where)
        del os.environ["GROUP_RANK"]


def test_two_nodes_with_different_copies_of_a_prefix_are_refused_before_step_1(tmp_path):
    """Two node ranks on one host, each with its own copy of a Megatron-LM prefix (and its own index cache),
    one copy altered: every rank refuses, naming both nodes and the .bin; equal copies train."""
    prepare_data("stdlib", "byte", tmp_path / "prepared", val_fraction=VAL_FRACTION, max_bytes=MAX_BYTES)
    for node in ("node0", "node1"):
        (tmp_path / node / "data").mkdir(parents=True)
        for kind in ("bin", "idx"):
            (tmp_path / node / "data" / f"web.{kind}").write_bytes((tmp_path / "prepared" / f"shard_00000.{kind}")
                                                                   .read_bytes())
    cfg = _pretrain_config(tmp_path / "unused", tmp_path / "run", "--data.blend=[{path: data/web, weight: 1}]",
                           f"--data.index_cache={tmp_path / 'cache'}")
    assert run_distributed(_build_data_as_node, 2, 1, cfg, str(tmp_path)) == [None, None]
    altered = tmp_path / "node1" / "data" / "web.bin"
    data = bytearray(altered.read_bytes())
    data[len(data) // 2] ^= 0x01  # one token, another id of the vocabulary
    altered.write_bytes(bytes(data))
    said = run_distributed(_build_data_as_node, 2, 1, cfg, str(tmp_path))
    assert said[0] == said[1] and said[0].startswith("the ranks read different copies of data/web.bin: "), said
    assert " on node 0 on " in said[0] and " (ranks 0)" in said[0] and " on node 1 on " in said[0], said


def _tiny_run_args(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    """pretrain.py's arguments for a few steps of a tiny model on the stdlib data of `data_dir`."""
    return ["--config", str(ROOT / "configs" / "gpt_tiny.yaml"), "--model.hidden_size=32", "--model.num_layers=2",
            "--model.max_seq_len=32", "--data.seq_len=32", "--training.global_batch_size=4",
            "--training.micro_batch_size=2", "--logging.progress_bar=false", "--logging.tensorboard=false",
            "--parallel.tensor_parallel_size=1", "--data.source=stdlib", f"--data.max_bytes={MAX_BYTES}",
            f"--data.val_fraction={VAL_FRACTION}", f"--data.data_dir={data_dir}", f"--logging.run_dir={run_dir}",
            *extra]


def test_pretraining_on_a_zeroed_token_file_stops_at_its_first_read_with_exit_2(tmp_path):
    data_dir = tmp_path / "data"
    prepare_data("stdlib", "byte", data_dir, val_fraction=VAL_FRACTION, max_bytes=MAX_BYTES)
    _zero(data_dir / "shard_00000.bin")
    args = _tiny_run_args(data_dir, tmp_path / "run", "--training.max_steps=2")
    # real: what torchrun itself reports of every worker (tests/launch.py, run_command)
    result = run_command(torchrun_command("pretrain.py", 2, args), cwd=ROOT, env=environment(),
                         capture_output=True, text=True, timeout=240, real=True)
    said = [line for line in result.stderr.splitlines() if line.startswith("config error: ")]
    assert len(said) == 1 and f"{data_dir / 'shard_00000.bin'} has sha256 " in said[0], result.stderr[-4000:]
    exit_codes = [line.split(":")[1].split()[0] for line in result.stderr.splitlines() if "exitcode  :" in line]
    assert exit_codes == ["2", "2"], result.stderr[-4000:]
    # torchrun prints its own ChildFailedError traceback; none comes from the package or the script
    assert "parallel_attention/" not in result.stderr and 'pretrain.py", line' not in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _build_data_on_a_full_disk(cfg):
    """build_data with every write of an index cache's arrays failing for want of space: the error message."""
    import errno as errors

    from parallel_attention.training.data.read import source_index

    real = source_index.write_streams

    def full(directory, *args):
        (directory / "train_starts.npy").write_bytes(b"\x93NUMPY")
        yield "0 documents indexed"
        raise OSError(errors.ENOSPC, "No space left on device")

    source_index.write_streams = full
    try:
        return _build_data_on_each_rank(cfg, None)
    finally:
        source_index.write_streams = real


def test_an_index_cache_on_a_full_disk_names_the_cause_on_every_rank(tmp_path):
    prepare_data("stdlib", "byte", tmp_path / "prepared", val_fraction=VAL_FRACTION, max_bytes=MAX_BYTES)
    cfg = _pretrain_config(tmp_path / "unused", tmp_path / "run",
                           f"--data.blend=[{{path: {tmp_path / 'prepared' / 'shard_00000'}, weight: 1}}]",
                           f"--data.index_cache={tmp_path / 'cache'}")
    said = run_distributed(_build_data_on_a_full_disk, 2, 1, cfg, timeout=120)
    assert said[0] == said[1] and "No space left on device" in said[0] and "no space is left there" in said[0], said
    assert "set data.index_cache to a writable directory with room" in said[0], said


def _read_with_a_fault_on_rank_1():
    """Each rank reads a step through the prefetcher, then meets the others in a collective: rank 1's read fails."""
    import torch

    from parallel_attention.tensor_parallel import parallel_state as ps
    from parallel_attention.tensor_parallel.collectives import all_reduce
    from parallel_attention.training.data.read.batch_prefetch import BatchPrefetcher

    def read(step):
        if ps.get_global_rank() == 1 and step == 1:
            raise DataFileError("x.bin has sha256 A in its chunk 3")
        return step

    loader = BatchPrefetcher(read)
    try:
        for step in range(3):
            assert loader.get(step)[0] == step
            all_reduce(torch.ones(1), None)  # the step's gradients
    except DataFileError as error:
        return step, str(error)
    finally:
        loader.close()
    return None


def test_a_data_fault_on_one_rank_ends_every_rank_with_its_message():
    """The others do not wait in their next collective for a rank that stopped: every rank raises its fault."""
    said = run_distributed(_read_with_a_fault_on_rank_1, 2, 1, timeout=60)
    assert said == [(1, "x.bin has sha256 A in its chunk 3 (found by global rank 1)")] * 2


FAULT_ON_RANK_1 = """
import os, runpy, sys
from parallel_attention.training.data.read import batches
from parallel_attention.training.data.token_files import DataFileError

real = batches.GlobalBatchSampler.local_micro_batches

def read(self, step, *args, **kwargs):
    if os.environ["RANK"] == "1" and step == 1:  # as ChunkVerifier refuses a chunk only this rank reads
        raise DataFileError("shard_00000.bin has sha256 X in its chunk 7 of 1024 bytes (from byte 7168), but Y "
                            "was recorded")
    return real(self, step, *args, **kwargs)

batches.GlobalBatchSampler.local_micro_batches = read
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_pretraining_with_a_fault_on_one_data_parallel_rank_ends_every_rank_with_its_message(tmp_path):
    """Rank 1 alone refuses a chunk at step 1: every rank exits 2 within timeout_s, rank 0 says the fault once,
    and no backend traceback ("Connection closed by peer") appears."""
    data_dir, wrapper = tmp_path / "data", tmp_path / "fault.py"
    prepare_data("stdlib", "byte", data_dir, val_fraction=VAL_FRACTION, max_bytes=MAX_BYTES)
    wrapper.write_text(FAULT_ON_RANK_1)
    args = _tiny_run_args(data_dir, tmp_path / "run", "--training.max_steps=3", "--parallel.timeout_s=30")
    command = torchrun_command("pretrain.py", 2, args)
    script = command.index(str(ROOT / "scripts" / "pretrain.py"))
    command[script:script] = [str(wrapper)]
    began = time.monotonic()
    result = run_command(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=240)
    assert time.monotonic() - began < 30 + 60 and result.returncode != 0, result.stderr[-4000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("config error: ")]
    assert said == ["config error: shard_00000.bin has sha256 X in its chunk 7 of 1024 bytes (from byte 7168), but Y "
                    "was recorded (found by global rank 1)"], result.stderr[-4000:]
    assert "Connection closed" not in result.stderr and "gloo" not in result.stderr.lower(), result.stderr[-4000:]
    assert 'pretrain.py", line' not in result.stderr and "CollectiveTimeoutError" not in result.stderr


def test_data_prepared_for_a_larger_vocabulary_than_the_model_is_a_config_error(data_cfg):
    from parallel_attention.training.data.read.batches import open_run_blend

    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", [f"--data.data_dir={data_cfg.data_dir}",
                                                           "--model.vocab_size=100"])
    with pytest.raises(DataFileError, match=r"prepared with the tokenizer byte of 256 tokens .* model.vocab_size=100: "
                                            r"set model.vocab_size >= 256"):
        open_run_blend(cfg)
