"""Whether a prepared data directory can be trained on: meta.json, the sizes it records, the sha256 of the token
files, and the ids read from them. Every refusal names the file and how to prepare it again.

A directory without a readable meta.json, or whose files lack the sizes it records, is not complete data
(`meta_and_reason` says why); a file of the recorded size whose sha256 differs was changed after preparation (a
bad copy, a disk fault, someone else's write); data prepared with other settings than a run's config belongs to
another run. All are refused with `DataFileError`, never prepared over: which copy is right is the user's call.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from pathlib import Path

import numpy as np

from ...checkpointing.tensor_io import file_digest
from ..config.checks import ConfigError
from . import previous_format
from .preparation_command import preparation_command
from ..tokenizer import TokenizerIdentity, TokenizerUnavailableError, trains_bpe

__all__ = ["REFUSALS", "DataFileError", "meta_and_reason", "prepare_again", "refusal_message", "recorded_meta",
           "refuse_other_settings", "is_previous_format", "sha256_of", "verify_at_start", "verify_files"]

META = "meta.json"
FORMAT_VERSION = 2  # shards in Megatron-LM's indexed-dataset format; 1 (no "format_version" key): train/val .bin
SHA_CACHE = ".sha256-cache.json"
_RACY_NS = 2_000_000_000  # a hash taken this soon after the file's last write is not trusted next time


class DataFileError(ConfigError):
    """A prepared data file that cannot be trained on; the message names the file and the fix."""


# what preparing or opening the data raises for a cause the user must fix: every rank then refuses the run alike
REFUSALS = (ValueError, OSError, TokenizerUnavailableError)


def refusal_message(error: BaseException, data_dir) -> str:
    """One line for a REFUSALS error: its own message when it names the value and the fix (ValueErrors do)."""
    if isinstance(error, ValueError):
        return str(error)
    return (f"data.data_dir={str(data_dir)!r} cannot be prepared or read ({type(error).__name__}: {error}): check "
            f"that the directory is writable with room to spare, or point data.data_dir elsewhere.")


def prepare_again(data_dir, meta: dict | None = None) -> str:
    """The fix for a bad data directory: prepare it anew with the settings it was prepared with (those of `meta`,
    else of the meta.json it holds, complete or not; the trainer prepares a data.data_dir that does not exist)."""
    meta = meta if meta is not None else recorded_meta(data_dir)
    return (f"prepare it again as it was prepared: run `{preparation_command(data_dir, meta)}` (or, for a run's "
            f"data.data_dir, delete {data_dir} and start the run again: it prepares data.data_dir from data.source), "
            "or point data.data_dir at a new directory")


def recorded_meta(data_dir) -> dict | None:
    """The settings the meta.json of `data_dir` records, even where its files are missing or truncated; None
    without a readable one."""
    try:
        meta = json.loads((Path(data_dir) / META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def meta_and_reason(data_dir) -> tuple[dict | None, str]:
    """(meta, "") for a complete preparation whose files have the recorded sizes, else (None, why not).

    Format 2 (`"format_version": 2`) is a list of indexed-dataset shards; the previous format (no
    "format_version") is train/val .bin files with .idx offsets, which directories prepared before offsets were
    kept lack and still read."""
    path = Path(data_dir) / META
    if not path.is_file():
        return None, f"{META} missing"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        version = meta.get("format_version", 1)
        if version not in (1, FORMAT_VERSION):
            return None, (f"{path} records format_version {version!r}, which this version cannot read (it knows 1 "
                          f"and {FORMAT_VERSION}): a newer release wrote it")
        sizes = _recorded_sizes(meta)
    except (OSError, UnicodeDecodeError) as error:
        return None, f"{path} cannot be read ({error})"
    except (ValueError, KeyError, TypeError, AttributeError) as error:  # JSONDecodeError is a ValueError
        return None, f"{path} is not a valid {META} ({type(error).__name__}: {error})"
    for name, recorded in sizes.items():
        file = Path(data_dir) / name
        if not file.is_file():
            return None, f"{name} missing"
        if file.stat().st_size != recorded:
            return None, f"{name} has {file.stat().st_size} bytes, {META} records {recorded}"
    return meta, ""


def is_previous_format(meta: dict) -> bool:
    """A meta.json of the previous format (previous_format.py): no "format_version", which reads as 1."""
    return meta.get("format_version", 1) != FORMAT_VERSION


def _recorded_sizes(meta: dict) -> dict[str, int]:
    """Each data file's size in bytes, from the counts meta.json records."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    if is_previous_format(meta):
        return previous_format.recorded_sizes(meta, itemsize)
    sizes = {}
    for shard in meta["shards"]:
        sizes[f"{shard['prefix']}.bin"] = int(shard["num_tokens"]) * itemsize
        sizes[f"{shard['prefix']}.idx"] = index_bytes(int(shard["num_documents"]))
    return sizes


def index_bytes(num_documents: int) -> int:
    """The size of a shard's .idx of one sequence per document: a 34-byte header, an int32 length and an int64
    pointer per sequence, and num_documents + 1 int64 document indices (indexed_dataset.py has the layout)."""
    return 34 + 12 * num_documents + 8 * (num_documents + 1)


def refuse_other_settings(data_dir, meta: dict, wanted: dict) -> None:
    """DataFileError when `meta` was prepared with other settings than `wanted` (the config's): a run never
    rewrites data it did not prepare, so it names the key, both values and the ways out."""
    for key, value in wanted.items():
        if meta.get(key) == value:
            continue
        if key == "tokenizer_sha256":
            raise DataFileError(
                f"data.tokenizer={meta.get('tokenizer')!r} has sha256 {value}, but {Path(data_dir) / META} records "
                f"{meta.get(key)}: the tokenizer changed since the data was prepared, and its ids would not mean what "
                f"the data's ids mean. Use the tokenizer the data was prepared with, point data.data_dir at another "
                f"directory (it is prepared there), or delete {data_dir} to prepare it again.")
        tokenizer = TokenizerIdentity.from_meta(meta).describe()
        raise DataFileError(
            f"data.data_dir={str(data_dir)!r} holds data prepared with data.{key}={meta.get(key)!r}, but the config "
            f"gives data.{key}={value!r} (that data's tokenizer: {tokenizer}"
            + ("; data.tokenizer=bpe would train another one on the new data" if trains_bpe(wanted.get("tokenizer"))
               else "") + f"). A run never rewrites data it did not prepare: set data.{key}="
            f"{_yaml(meta.get(key))} to train on this data, point data.data_dir at another directory (it is prepared "
            f"there), or delete {data_dir} to prepare it again.")


def _yaml(value) -> str:
    return "null" if value is None else str(value)


def verify_files(data_dir, meta: dict, tokenizer_files: dict[str, str]) -> None:
    """DataFileError unless every file a run reads has the sha256 meta.json records: each shard's .bin and .idx
    (format 2), or train/val .bin (the previous format, which recorded no hash for its .idx files: their offsets
    are checked instead), and `tokenizer_files` (TokenizerIdentity.data_dir_files of meta.json's tokenizer)."""
    data_dir = Path(data_dir)
    for name, recorded in recorded_hashes(meta, tokenizer_files).items():
        _check_sha256(data_dir / name, recorded, data_dir, meta)
    if is_previous_format(meta):
        _check_offsets(data_dir, meta)


def verify_at_start(data_dir, meta: dict, tokenizer_files: dict[str, str]) -> None:
    """What a start verifies, without reading the corpus: `tokenizer_files` (the trained BPE's tokenizer.json:
    TokenizerIdentity.data_dir_files of meta.json's tokenizer, which the caller owns), and the files whose
    hash meta.json records only whole (data prepared before chunk hashes, checked as verify_files does). A .bin
    with `bin_chunk_sha256` is verified chunk by chunk as it is read (source_index.ChunkVerifier), each .idx when the
    source's index cache is built (source_index.py)."""
    data_dir = Path(data_dir)
    chunked = {f"{s['prefix']}.{kind}" for s in meta.get("shards", []) if s.get("bin_chunk_sha256") is not None
               for kind in ("bin", "idx")}
    for name, recorded in recorded_hashes(meta, tokenizer_files).items():
        if name not in chunked:
            _check_sha256(data_dir / name, recorded, data_dir, meta)
    if is_previous_format(meta):
        _check_offsets(data_dir, meta)


def recorded_hashes(meta: dict, tokenizer_files: dict[str, str]) -> dict[str, str]:
    """{file name: sha256} of every hashed file meta.json names, `tokenizer_files` with them."""
    if is_previous_format(meta):
        hashes = previous_format.recorded_hashes(meta)
    else:
        hashes = {f"{s['prefix']}.{kind}": s[f"{kind}_sha256"] for s in meta["shards"] for kind in ("bin", "idx")}
    return {**hashes, **tokenizer_files}


def _check_sha256(path: Path, recorded: str, data_dir: Path, meta: dict) -> None:
    actual = sha256_of(path) if path.is_file() else "(missing)"
    if actual != recorded:
        raise DataFileError(f"{path} has sha256 {actual} but {data_dir / META} records {recorded}: the file "
                            f"changed after it was prepared (a bad copy, a disk fault, another write); "
                            f"{prepare_again(data_dir, meta)}.")


def _check_offsets(data_dir: Path, meta: dict) -> None:
    """The previous format's .idx files: document starts from 0, increasing, inside their split's tokens."""
    problem = previous_format.offsets_problem(data_dir, meta)
    if problem is not None:
        raise DataFileError(f"{problem}: the file changed after it was prepared; {prepare_again(data_dir, meta)}.")


def sha256_of(path: Path) -> str:
    """The sha256 of `path`, from the directory's cache when the file is unchanged since it was hashed.

    Hashing a large corpus on every start costs minutes, so each hash is kept in .sha256-cache.json beside the
    files, keyed by (size, mtime_ns, ctime_ns, inode): writing a file in place changes its mtime and ctime,
    replacing it changes its inode, and ctime cannot be set back by hand. A hash taken within _RACY_NS of the
    file's last write is not trusted later (a write in the same clock tick could keep the mtime: git's racy-clean
    rule), so it is taken again then. What the cache cannot see is corruption beneath the filesystem (bit rot);
    delete the cache file to re-hash everything. A read-only directory means no cache, never an error.
    """
    stat, cache = path.stat(), _read_cache(path.parent)
    key = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
    entry = cache.get(path.name)
    if isinstance(entry, dict) and entry.get("key") == key and entry.get("hashed_at_ns", 0) - _RACY_NS > key[1]:
        return entry["sha256"]
    hashed_at = time.time_ns()
    sha256 = file_digest(path)["sha256"]
    cache[path.name] = {"key": key, "hashed_at_ns": hashed_at, "sha256": sha256}
    _write_cache(path.parent, cache)
    return sha256


def _read_cache(data_dir: Path) -> dict:
    try:
        cache = json.loads((data_dir / SHA_CACHE).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or a torn or foreign file: start afresh
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(data_dir: Path, cache: dict) -> None:
    """Atomically (a unique temporary, renamed over it): ranks on several hosts may write at once."""
    tmp = data_dir / f".{SHA_CACHE}.tmp-{secrets.token_hex(6)}"
    try:
        tmp.write_text(json.dumps(cache, indent=1), encoding="utf-8")
        os.replace(tmp, data_dir / SHA_CACHE)
    except OSError:  # a read-only data directory: no cache, the hash is simply taken again next time
        with contextlib.suppress(OSError):
            tmp.unlink()
