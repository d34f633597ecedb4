"""Index caches and chunked verification: a source's per-document arrays are built once into .npy files that every
process memory-maps (the same values the in-memory build held, so batches are unchanged), by one process while the
others wait on the filesystem, never inside a collective; each .bin chunk is verified when first read; a Megatron
prefix's changed .bin is refused at resume."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from launch import ROOT, environment, metrics, run_command
from parallel_attention.checkpointing.tensor_io import file_digest
from parallel_attention.training.data import chunk_hashes
from parallel_attention.training.data.read import index_cache, source_index
from parallel_attention.training.data.read.data_identity import DataChangedError, check_identity, source_record
from parallel_attention.training.data.indexed_dataset import IndexedDatasetWriter, token_dtype
from parallel_attention.training.data.token_files import DataFileError
from parallel_attention.training.data.read.token_source import TokenStream, open_source

VOCAB = 256


def _prefix(path, lengths, seed=0) -> str:
    """A Megatron-LM prefix of documents of `lengths` tokens (0: an empty document, still a document)."""
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(path, token_dtype(VOCAB))
    for n in lengths:
        writer.add_document(rng.integers(1, VOCAB, n))
    writer.finish()
    return str(path)


def _reference(lengths, val_fraction):
    """(train, val) as lists of (source start, length, document) by the rule written out plainly: documents in
    order, document i held out when floor((i + 1) f) > floor(i f) (the last if none is)."""
    starts = np.concatenate([[0], np.cumsum(lengths)])
    documents = [(int(starts[i]), int(n)) for i, n in enumerate(lengths)]
    if len(documents) == 1:
        (start, n), = documents
        cut = max(1, int(round(n * val_fraction)))
        return [(start, n - cut, 0)], [(start + n - cut, cut, 0)]
    held = [np.floor((i + 1) * val_fraction) > np.floor(i * val_fraction) for i in range(len(documents))]
    if not any(held):
        held[-1] = True
    train = [(s, n, i) for i, ((s, n), h) in enumerate(zip(documents, held)) if not h]
    return train, [(s, n, i) for i, ((s, n), h) in enumerate(zip(documents, held)) if h]


def _segments(stream):
    lengths = np.diff(stream.segment_starts)
    return list(zip(stream.segment_source.tolist(), lengths.tolist(), stream.segment_document.tolist()))


@pytest.mark.parametrize("lengths, val_fraction", [([7, 0, 3, 9, 0, 0, 5, 11, 2, 4, 8], 0.2), ([40], 0.1),
                                                   ([5, 6, 7], 0.02), ([0, 12, 0], 0.25)])
def test_the_cached_streams_hold_what_the_rule_gives(tmp_path, monkeypatch, lengths, val_fraction):
    monkeypatch.setattr("parallel_attention.training.data.indexed_dataset._PIECE", 2)  # many pieces
    source = open_source(_prefix(tmp_path / "p", lengths), val_fraction, (VOCAB, "byte"), index_cache=tmp_path / "c")
    train, val = _reference(lengths, val_fraction)
    assert _segments(source.train) == train and _segments(source.val) == val
    assert isinstance(source.train.segment_starts, np.memmap)  # mapped, not held: memory does not grow with it
    assert source.num_documents == len(lengths)


def test_the_coarse_index_finds_what_a_search_of_all_starts_finds(tmp_path, monkeypatch):
    monkeypatch.setattr(source_index, "COARSE", 3)
    lengths = [int(n) for n in np.random.default_rng(1).integers(0, 9, 200)]  # empty documents: repeated starts
    source = open_source(_prefix(tmp_path / "p", lengths), 0.05, (VOCAB, "byte"), index_cache=tmp_path / "c")
    for stream in (source.train, source.val):
        assert stream.coarse[0] == 3 and stream.coarse[1].tolist() == stream.segment_starts[::3].tolist()
        positions = np.arange(stream.num_tokens)
        whole = np.searchsorted(np.asarray(stream.segment_starts), positions, side="right") - 1
        assert np.array_equal(stream.window_documents(positions, 1)[:, 0], stream.segment_document[whole])
        offsets = np.arange(0, stream.num_tokens - 8, 5)
        plain = TokenStream(stream.shards, (stream.segment_starts, stream.segment_source, stream.segment_document),
                            (VOCAB, "byte"), "p")
        assert np.array_equal(stream.windows(offsets, 8), plain.windows(offsets, 8))


def _cache(root, name, key, build, what):
    """index_cache.claim, then the build here when this caller holds the lock: (directory, info)."""
    found = index_cache.claim(root, name, key, what)
    if found[2] is None:
        return found[:2]
    with found[2] as slot:
        return found[0], slot.store(build(slot.tmp, slot.progress))


def test_one_build_while_the_others_wait_and_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(index_cache, "POLL_S", 0.01)
    builds, release = [], threading.Event()

    def build(tmp, progress):
        builds.append(1)
        release.wait(10)
        (tmp / "x.npy").write_bytes(b"1")
        return {"n": 1}

    results = []
    threads = [threading.Thread(target=lambda: results.append(_cache(tmp_path, "s", {"k": 1}, build,
                                                                                  "test"))) for _ in range(3)]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(20)
    assert len(builds) == 1 and len(results) == 3 and len({str(d) for d, _ in results}) == 1
    assert results[0][1]["n"] == 1 and results[0][1]["key"] == {"k": 1}

    def broken(tmp, progress):
        (tmp / "half.npy").write_bytes(b"1")
        raise DataFileError("killed half way")

    with pytest.raises(DataFileError):
        _cache(tmp_path, "t", {"k": 2}, broken, "test")
    failed = index_cache.cache_directory(tmp_path, "t", {"k": 2}).name
    # no lock, no temporary, no cache: only the failure's marker, which the waiters read
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([results[0][0].name, f".{failed}.failed"])
    assert (tmp_path / f".{failed}.failed").read_text() == "killed half way"


def test_a_stale_lock_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setattr(index_cache, "STALE_S", 0.0)
    monkeypatch.setattr(index_cache, "POLL_S", 0.01)
    key = {"k": 3}
    directory, _ = _cache(tmp_path, "s", key, lambda tmp, progress: {}, "test")
    lock = tmp_path / f".{directory.name}.lock"
    (directory / index_cache.INFO).unlink()  # as if never finished, its builder dead
    lock.write_text("gone pid 1\n")
    assert _cache(tmp_path, "s", key, lambda tmp, progress: {"again": True}, "test")[1]["again"]


def test_a_lock_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path, monkeypatch):
    """A build killed (SIGKILL, an OOM kill) leaves its lock: the relaunch on its host does not wait STALE_S."""
    monkeypatch.setattr(index_cache, "POLL_S", 0.01)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    key = {"k": 4}
    lock = tmp_path / f".{index_cache.cache_directory(tmp_path, 's', key).name}.lock"
    lock.write_text(f"holder {socket.gethostname()} pid {dead.pid}\n")
    began = time.monotonic()
    assert _cache(tmp_path, "s", key, lambda tmp, progress: {"built": True}, "test")[1]["built"]
    assert time.monotonic() - began < 5  # STALE_S is 600
    (index_cache.cache_directory(tmp_path, "s", key) / index_cache.INFO).unlink()
    lock.write_text(f"{socket.gethostname()} pid {dead.pid}\n")  # as an earlier release wrote it
    assert _cache(tmp_path, "s", key, lambda tmp, progress: {"again": True}, "test")[1]["again"]
    lock.write_text(f"holder {socket.gethostname()} pid {os.getpid()}\n")  # alive: waited for, not taken over
    monkeypatch.setattr(index_cache, "STALE_S", 0.5)
    other = _cache(tmp_path, "s", {"k": 5}, lambda tmp, progress: {}, "test")  # another key: no wait
    assert other[1] == {"key": {"k": 5}}


@pytest.mark.parametrize("recorded", [True, False])
def test_a_build_that_fails_for_a_full_disk_is_reported_by_every_waiter(tmp_path, monkeypatch, recorded):
    """The builder's cause (no space left) and the setting to change reach the processes waiting for it, who
    raise it instead of building again in turn; with no room for the message, they still name the builder."""
    monkeypatch.setattr(index_cache, "POLL_S", 0.01)
    started, release, errors = threading.Event(), threading.Event(), []

    def full(tmp, progress):
        started.set()
        release.wait(10)
        if not recorded:  # the marker cannot be written either
            monkeypatch.setattr(Path, "write_text", _no_space)
        raise OSError(errno.ENOSPC, "No space left on device")

    def one(build):
        try:
            _cache(tmp_path, "s", {"k": 6}, build, "the index of x")
        except DataFileError as error:
            errors.append(str(error))

    builder = threading.Thread(target=one, args=(full,))
    builder.start()
    started.wait(10)
    waiters = [threading.Thread(target=one, args=(lambda tmp, progress: pytest.fail("built again"),))
               for _ in range(2)]
    for t in waiters:
        t.start()
    time.sleep(0.2)  # the waiters see the lock
    release.set()
    for t in [builder, *waiters]:
        t.join(20)
    assert len(errors) == 3
    assert all("data.index_cache" in message and str(tmp_path) in message for message in errors)
    assert sum("no space is left there" in message for message in errors) == (3 if recorded else 1)  # the builder


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_an_unwritable_index_cache_of_a_prepared_directory_falls_back_to_data_index_cache(tmp_path, monkeypatch):
    """A complete DIR/.index_cache is read even where it cannot be written; one that this process cannot write
    (another user's, read-only) and that lacks the index sends it under data.index_cache, where it is then read."""
    prefix = Path(_prefix(tmp_path / "p", [50] * 10))
    data = tmp_path / "data"
    data.mkdir()
    meta = _prepared_meta(prefix, data)
    built, _ = source_index.prepared_index(data, meta, 0.1, tmp_path / "fallback")
    assert built.parent == data / source_index.CACHE_DIR
    writable = os.access
    monkeypatch.setattr(source_index.os, "access", lambda path, mode: False)  # read-only now: the cache is read
    assert source_index.prepared_index(data, meta, 0.1, tmp_path / "elsewhere")[0] == built
    shutil.rmtree(built)  # gone, and .index_cache itself cannot be written
    monkeypatch.setattr(source_index.os, "access",
                        lambda path, mode: False if Path(path).name == source_index.CACHE_DIR else writable(path, mode))
    directory, info = source_index.prepared_index(data, meta, 0.1, tmp_path / "fallback")
    assert directory.parent == tmp_path / "fallback" and info["num_documents"] == 10
    monkeypatch.setattr(source_index.os, "access", writable)  # the cache built there is the one read
    assert source_index.prepared_index(data, meta, 0.1, tmp_path / "fallback")[0] == directory


def test_a_prepared_directory_on_a_full_disk_indexes_under_data_index_cache(tmp_path, monkeypatch, capfd):
    """A build in DIR/.index_cache that fails for want of space (or permission) is made under data.index_cache,
    saying why; the next start finds it there without trying DIR/.index_cache again."""
    prefix = Path(_prefix(tmp_path / "p", [50] * 10))
    data = tmp_path / "data"
    data.mkdir()
    meta = _prepared_meta(prefix, data)
    real, tried = source_index.write_streams, []

    def full_in_data(directory, *args):
        tried.append(directory.parent)
        if directory.parent == data / source_index.CACHE_DIR:
            raise OSError(errno.ENOSPC, "No space left on device")
        return (yield from real(directory, *args))

    monkeypatch.setattr(source_index, "write_streams", full_in_data)
    directory, info = source_index.prepared_index(data, meta, 0.1, tmp_path / "fallback")
    assert directory.parent == tmp_path / "fallback" and info["num_documents"] == 10
    said = capfd.readouterr().err
    assert "No space left on device" in said and f"under data.index_cache ({tmp_path / 'fallback'}) instead" in said
    assert source_index.prepared_index(data, meta, 0.1, tmp_path / "fallback")[0] == directory
    assert tried == [data / source_index.CACHE_DIR, tmp_path / "fallback"]  # not tried again


def _prepared_meta(prefix: Path, data: Path) -> dict:
    """A format-2 meta.json in `data` of the one shard at `prefix` (moved there)."""
    for kind in ("bin", "idx"):
        os.replace(f"{prefix}.{kind}", data / f"shard_00000.{kind}")
    shard = data / "shard_00000"
    sha, chunks = chunk_hashes.file_and_chunk_sha256(Path(f"{shard}.bin"))
    meta = {"format_version": 2, "shards": [{"prefix": "shard_00000", "idx_sha256": file_digest(Path(f"{shard}.idx"))[
        "sha256"], "bin_sha256": sha, "bin_chunk_sha256": chunks, "chunk_bytes": chunk_hashes.CHUNK_BYTES}]}
    (data / "meta.json").write_text(json.dumps(meta))
    return meta


def test_a_changed_chunk_stops_the_read_naming_file_and_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(source_index, "CHUNK_BYTES", 64)  # 32 uint16 tokens a chunk
    prefix = _prefix(tmp_path / "p", [50] * 10)
    source = open_source(prefix, 0.1, (VOCAB, "byte"), index_cache=tmp_path / "c")
    assert len(source.index["shards"][0]["chunk_sha256"]) == -(-500 * 2 // 64)
    raw = bytearray(open(f"{prefix}.bin", "rb").read())
    raw[5 * 64 + 3] ^= 1  # chunk 5: tokens 160..191
    open(f"{prefix}.bin", "r+b").write(bytes(raw))
    source.train.windows([0], 20)  # chunk 0 only: read
    with pytest.raises(DataFileError, match=rf"{prefix}.bin has sha256 \w+ in its chunk 5 of 64 bytes .*delete"):
        source.train.windows([150], 20)
    assert 0 in source.train.verifiers[0].verified and 5 not in source.train.verifiers[0].verified


def test_verified_chunks_are_remembered_so_a_restart_does_not_hash_them_again(tmp_path, monkeypatch):
    monkeypatch.setattr(source_index, "CHUNK_BYTES", 64)  # 32 uint16 tokens a chunk
    prefix = _prefix(tmp_path / "p", [50] * 10)
    hashed = []
    real = source_index.hash_range
    monkeypatch.setattr(source_index, "hash_range", lambda f, start, count: hashed.append(start) or real(f, start, count))
    first = open_source(prefix, 0.1, (VOCAB, "byte"), index_cache=tmp_path / "c")
    first.train.windows([0, 100], 20)
    seen = set(first.train.verifiers[0].verified)
    assert len(hashed) == len(seen) >= 2
    again = open_source(prefix, 0.1, (VOCAB, "byte"), index_cache=tmp_path / "c")  # a restart: the same cache
    assert again.train.verifiers[0].verified == seen
    again.train.windows([0, 100], 20)
    assert len(hashed) == len(seen)  # nothing hashed again
    again.train.windows([400], 20)  # near the end: chunks not read before
    assert len(hashed) > len(seen) and min(hashed[len(seen):]) > max(seen) * 64
    raw = bytearray(open(f"{prefix}.bin", "rb").read())
    raw[2] ^= 1  # another id of the vocabulary
    open(f"{prefix}.bin", "r+b").write(bytes(raw))  # a changed file is another key: nothing of it is trusted
    assert open_source(prefix, 0.1, (VOCAB, "byte"), index_cache=tmp_path / "c").train.verifiers[0].verified == set()


def test_a_superseded_cache_is_deleted_when_its_successor_is_built(tmp_path):
    prefix = _prefix(tmp_path / "p", [50] * 10)
    old = open_source(prefix, 0.1, (VOCAB, "byte"), index_cache=tmp_path / "c")
    other = open_source(prefix, 0.2, (VOCAB, "byte"), index_cache=tmp_path / "c")  # another val_fraction: kept
    assert len(list((tmp_path / "c").glob("p-*"))) == 2
    os.utime(f"{prefix}.bin")  # touched: another key, the same source
    new = open_source(prefix, 0.1, (VOCAB, "byte"), index_cache=tmp_path / "c")
    caches = {p.name for p in (tmp_path / "c").glob("p-*")}
    assert caches == {_cache_name(other), _cache_name(new)}
    assert _cache_name(old) not in caches


def _cache_name(source) -> str:
    return index_cache.cache_directory(Path("."), "p", source.index["key"]).name


def test_a_runs_default_index_cache_is_shared_by_the_runs_beside_it(tmp_path):
    from parallel_attention.training import load_config
    from parallel_attention.training.data.read.token_source import index_cache_root

    roots = {index_cache_root(load_config(ROOT / "configs" / "gpt_tiny.yaml", [f"--logging.run_dir={tmp_path / r}"]))
             for r in ("a", "b")}
    assert roots == {tmp_path / ".index_cache"}
    set_here = load_config(ROOT / "configs" / "gpt_tiny.yaml", [f"--data.index_cache={tmp_path / 'mine'}"])
    assert index_cache_root(set_here) == tmp_path / "mine"


def test_a_resume_on_a_changed_megatron_bin_is_refused_or_said(tmp_path, capfd):
    prefix = _prefix(tmp_path / "p", [30] * 8)
    identity = {"tokenizer": {"tokenizer": "byte", "sha256": None}, "sampling": "epochs"}

    def current():
        source = open_source(prefix, 0.1, (VOCAB, "byte"), index_cache=tmp_path / "c")
        return {**identity, "sources": [source_record(prefix, 1.0, source)]}

    saved = current()
    assert current() == saved  # the cache answers: nothing re-hashed, nothing changed
    raw = bytearray(open(f"{prefix}.bin", "rb").read())
    raw[10] ^= 1  # an in-vocabulary id: nothing else would notice
    open(f"{prefix}.bin", "r+b").write(bytes(raw))
    manifest = {"extra": {"data_identity": saved}, "path": "ckpt"}
    with pytest.raises(DataChangedError, match=r"\.bin "):
        check_identity(manifest, current(), allow_data_change=False)
    check_identity(manifest, current(), allow_data_change=True)
    assert "continuing on other data" in capfd.readouterr().err
    old = {**saved, "sources": [{k: v for k, v in saved["sources"][0].items() if k != "bin_chunks_sha256"}]}
    check_identity({"extra": {"data_identity": old}, "path": "ckpt"}, saved, allow_data_change=False)  # 0.x: passes


def test_meta_without_chunk_hashes_is_verified_whole_at_start(tmp_path):
    from parallel_attention.training import prepare_data
    data = tmp_path / "data"
    meta = prepare_data("stdlib", "byte", data, val_fraction=0.1, max_bytes=20_000)
    assert meta["shards"][0]["chunk_bytes"] == chunk_hashes.CHUNK_BYTES and meta["shards"][0]["bin_chunk_sha256"]
    for shard in meta["shards"]:
        del shard["bin_chunk_sha256"], shard["chunk_bytes"]
    (data / "meta.json").write_text(json.dumps(meta))
    source = open_source(str(data), 0.1, (VOCAB, "byte"))
    assert source.train.verifiers == [None] * len(meta["shards"])
    bin_file = data / "shard_00000.bin"
    bin_file.write_bytes(bytes(bin_file.stat().st_size))
    with pytest.raises(DataFileError, match="shard_00000.bin has sha256 "):
        open_source(str(data), 0.1, (VOCAB, "byte"))


SLOW = """
import runpy, sys, time
from parallel_attention.training.data.prepare import run_data_dir as prepared
from parallel_attention.training.data.read import source_index

def slowly(real):
    def slow(*args, **kwargs):
        time.sleep(8)  # longer than parallel.timeout_s=5
        return real(*args, **kwargs)
    return slow

source_index.write_streams = slowly(source_index.write_streams)
prepared.prepare_data = slowly(prepared.prepare_data)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


STALLED = """
import runpy, sys, time
from parallel_attention.training.data.read import source_index

def stalled(*args, **kwargs):
    time.sleep(600)  # killed before it ends
    yield ""

source_index.write_streams = stalled
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow  # the default run keeps the property: test_a_lock_of_a_dead_process_on_this_host_is_taken_over_at_once
def test_a_job_killed_while_indexing_a_prefix_is_relaunched_and_trains_at_once(tmp_path):
    """SIGKILL of the whole job while a rank builds a Megatron prefix's index leaves its lock; the relaunch on the
    same host takes it over at once (not after STALE_S) and trains 2 steps within 150 s."""
    wrapper, run = tmp_path / "stalled.py", tmp_path / "runs" / "run"
    wrapper.write_text(STALLED)
    prefix = _prefix(tmp_path / "web_text_document", [200] * 60)
    args = ["--config", str(ROOT / "configs" / "gpt_tiny.yaml"), "--model.hidden_size=32", "--model.num_layers=2",
            "--model.max_seq_len=32", "--data.seq_len=32", "--training.global_batch_size=4",
            "--training.micro_batch_size=2", "--training.max_steps=2", "--logging.progress_bar=false",
            "--logging.tensorboard=false", "--parallel.tensor_parallel_size=1", f"--logging.run_dir={run}",
            f"--data.blend=[{{path: '{prefix}', weight: 1.0}}]"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    first = subprocess.Popen([*launch, str(wrapper), str(ROOT / "scripts" / "pretrain.py"), *args], cwd=ROOT,
                             env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "runs" / ".index_cache").glob(".web_text_document-*.lock")):
            assert time.monotonic() < deadline and first.poll() is None, "no index build started"
            time.sleep(0.5)
    finally:
        os.killpg(first.pid, 9)  # the whole job, as an OOM kill or a scheduler's SIGKILL would
        first.wait(30)
    began = time.monotonic()
    again = run_command([*launch, str(ROOT / "scripts" / "pretrain.py"), *args], cwd=ROOT, env=environment(),
                        capture_output=True, text=True, timeout=300, real=True)
    assert again.returncode == 0 and time.monotonic() - began < 150, again.stderr[-4000:]
    assert "its process is gone); building it here" in again.stderr
    assert sorted(r["step"] for r in metrics(run) if "loss" in r) == [1, 2]


@pytest.mark.parametrize("data", ["blend", "data_dir"])
def test_preparing_or_indexing_longer_than_the_collective_timeout_still_starts_and_trains(tmp_path, data):
    """Rank 0 prepares (data_dir) and one rank indexes, each for longer than parallel.timeout_s, while the other
    waits on the filesystem; then both train."""
    wrapper, run = tmp_path / "slow.py", tmp_path / "run"
    wrapper.write_text(SLOW)
    if data == "blend":
        prefix = _prefix(tmp_path / "web_text_document", [200] * 60)
        where = [f"--data.blend=[{{path: '{prefix}', weight: 1.0}}]"]
    else:
        where = [f"--data.data_dir={tmp_path / 'data'}", "--data.source=stdlib", "--data.max_bytes=40000"]
    args = ["--config", str(ROOT / "configs" / "gpt_tiny.yaml"), "--model.hidden_size=32", "--model.num_layers=2",
            "--model.max_seq_len=32", "--data.seq_len=32", "--training.global_batch_size=4",
            "--training.micro_batch_size=2", "--training.max_steps=2", "--training.eval_interval=100",
            "--logging.log_interval=1", "--logging.progress_bar=false", "--logging.tensorboard=false",
            "--parallel.tensor_parallel_size=1", "--parallel.timeout_s=5", f"--logging.run_dir={run}", *where]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(wrapper),
               str(ROOT / "scripts" / "pretrain.py"), *args]
    result = run_command(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-6000:]
    assert sorted(r["step"] for r in metrics(run) if "loss" in r) == [1, 2]
    caches = list((tmp_path / ".index_cache").glob("web_text_document-*")) if data == "blend" else \
        list((tmp_path / "data" / ".index_cache").glob("prepared-*"))
    assert len(caches) == 1  # built once, by one rank
