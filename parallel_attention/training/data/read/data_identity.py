"""What a run was trained on, recorded in each checkpoint and checked on resume: its tokenizer and its data.

A model means nothing without the tokenizer its ids came from, and a resumed run that silently reads other data is
another experiment. So every checkpoint records `data_identity`: the tokenizer (its spec and the sha256 of its
tokenizer.json; byte and gpt2 are known by name), each source's path with the sha256 of what identifies its
content (a prepared directory's meta.json, which records every shard's hash; a Megatron-LM prefix's .idx and the
hashes of its .bin's chunks, from its index cache), and the sampling. A resume with another tokenizer is refused;
with other data it is refused unless `checkpoint.allow_data_change: true` asks for it (continued pretraining), and
then the run says what changed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ....checkpointing.format import CheckpointError, read_manifest
from ...config.schema import PretrainConfig
from ...config.checks import ConfigError
from .blend_history import continue_run_blend
from .source_index import chunks_digest
from .token_source import TokenSource, blend_entries, prepared_tokenizer
from ...tokenizer import TokenizerIdentity, copy_tokenizer

__all__ = ["DataChangedError", "check_identity", "check_tokenizer", "data_identity", "keep_run_tokenizer",
           "run_data_identity", "source_record", "source_sha256"]


class DataChangedError(ConfigError):
    """A resume onto another tokenizer, or onto other data without checkpoint.allow_data_change."""


def source_sha256(source: TokenSource) -> str:
    """What identifies a source's content: its meta.json (which records every shard's hash), or a Megatron-LM
    prefix's .idx (hashed once, when its index cache was built)."""
    return source.copies[0][1]


def source_record(path: str, weight: float, source: TokenSource) -> dict:
    """{path, sha256 (`source_sha256`), weight}, and for a prefix `bin_chunks_sha256`: one hash over its .bin's
    chunk hashes, from its index cache (read once)."""
    if source.meta is not None:
        return {"path": path, "sha256": source_sha256(source), "weight": weight}
    return {"path": path, "sha256": source_sha256(source), "weight": weight,
            "bin_chunks_sha256": chunks_digest(source.index)}


def data_identity(cfg: PretrainConfig, sources: list[TokenSource]) -> dict:
    """The tokenizer, each source (path as configured, sha256, weight) and the sampling of this run."""
    entries = blend_entries(cfg.data)
    tokenizer = TokenizerIdentity.of_file(cfg.data.tokenizer, prepared_tokenizer(sources, cfg.data.tokenizer))
    return {"tokenizer": tokenizer.record(),
            "sources": [source_record(e.path, e.weight, s) for e, s in zip(entries, sources)],
            "sampling": cfg.data.sampling}


def run_data_identity(cfg: PretrainConfig, sampler, manifest: dict | None) -> dict:
    """data_identity with the run's history of blends (blend_history.py), `sampler` set to continue it: where a
    resume under checkpoint.allow_data_change changed the blend, each source continues its own epochs."""
    identity = data_identity(cfg, sampler.sources)
    continue_run_blend(cfg, sampler, identity, manifest)
    return identity


def _bin_changed(saved: list[dict], current: list[dict]) -> bool:
    """A Megatron-LM .bin whose chunk hashes differ (checkpoints from before they were recorded pass)."""
    key = "bin_chunks_sha256"
    return any(a.get(key) and b.get(key) and a[key] != b[key] for a, b in zip(saved, current))


def _describe_source(s: dict) -> str:
    chunks = f", .bin {s['bin_chunks_sha256'][:12]}" if s.get("bin_chunks_sha256") else ""
    return f"{s['path']} x{s['weight']:g} ({s['sha256'][:12]}{chunks})"


def check_identity(manifest: dict, current: dict, allow_data_change: bool) -> None:
    """Raise DataChangedError when this run (`current`) may not continue the checkpoint of `manifest`; say what
    changed in the data when checkpoint.allow_data_change lets it. Checkpoints older than the record pass."""
    saved, where = manifest["extra"].get("data_identity"), manifest["path"]
    if not saved:
        return
    trained, now = (TokenizerIdentity.from_record(identity["tokenizer"]) for identity in (saved, current))
    if trained != now:
        raise DataChangedError(
            f"{where} was trained with the tokenizer {trained.describe()}, and this run's is "
            f"{now.describe()}: token ids would change meaning. Use another logging.run_dir to "
            "train a new model, or checkpoint.resume=none to start this one afresh (its checkpoints are then "
            "replaced).")
    content = [[(s["sha256"], s["weight"]) for s in identity["sources"]] + [identity["sampling"]]
               for identity in (saved, current)]
    if content[0] == content[1] and not _bin_changed(saved["sources"], current["sources"]):
        return  # the same data under another path is the same data
    before = ", ".join(_describe_source(s) for s in saved["sources"])
    after = ", ".join(_describe_source(s) for s in current["sources"])
    change = f"data {before}, {saved['sampling']} -> {after}, {current['sampling']}"
    if not allow_data_change:
        raise DataChangedError(
            f"{where} was trained on other data ({change}). To continue pretraining on the new data, set "
            "checkpoint.allow_data_change=true; to train afresh, use another logging.run_dir or "
            "checkpoint.resume=none.")
    if os.environ.get("RANK", "0") == "0":
        print(f"continuing on other data (checkpoint.allow_data_change): {change}", file=sys.stderr, flush=True)


def keep_run_tokenizer(cfg: PretrainConfig, sources: list[TokenSource]) -> None:
    """Copy the tokenizer the data was prepared with into RUN/tokenizer/ (generation and export read it there),
    once the run has resumed or started fresh: a refused resume leaves the run's own tokenizer as it was."""
    path = prepared_tokenizer(sources, cfg.data.tokenizer)
    if path is not None:
        copy_tokenizer(path, Path(cfg.logging.run_dir) / "tokenizer")


def check_tokenizer(step_dir: Path, tokenizer) -> None:
    """ValueError unless `tokenizer` (byte, gpt2 or a tokenizer.json's) is the one the checkpoint in `step_dir`
    was trained with, by its recorded sha256 (or name); checkpoints older than the record pass."""
    try:
        saved = read_manifest(step_dir, verify=False)["extra"]["data_identity"]
    except (CheckpointError, KeyError, TypeError):
        return
    have, want = TokenizerIdentity.of_tokenizer(tokenizer), TokenizerIdentity.from_record(saved["tokenizer"])
    if not want.same_file(have):
        raise ValueError(f"the tokenizer {have.name} (sha256 {have.sha256}) is not the one {step_dir} was "
                         f"trained with: {want.describe()}; it would decode the model's ids as other text. Pass "
                         "--tokenizer with that tokenizer's file (a run keeps it in RUN/tokenizer/).")
