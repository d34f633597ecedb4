"""A run's data directory: prepared once (shards.py) when it does not exist, never rewritten after.

On disk (`data_dir`, docs/data.md has the details): shards of Megatron-LM's indexed format
(`shard_NNNNN.bin` / `.idx`), the trained BPE's `tokenizer.json` for data.tokenizer=bpe, and `meta.json`, written
last, which records the settings and every file's sha256 (token_files.py checks them; `.sha256-cache.json` keeps
the hashes while the files are unchanged). The previous release's `train.bin` / `val.bin` directories still train.
Sources are read by read/token_source.py, batches drawn by read/batches.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .shards import source_key
from .shards import prepare_shards as prepare_data
from ...tokenizer import TokenizerIdentity, trains_bpe
from ..token_files import (DataFileError, is_previous_format, meta_and_reason, prepare_again, refuse_other_settings,
                           verify_at_start)

__all__ = ["ensure_prepared", "prepare_data", "read_meta"]


def read_meta(data_dir) -> dict | None:
    """meta.json of a complete preparation whose token (and offset) files have the recorded sizes, else None."""
    return meta_and_reason(data_dir)[0]


def ensure_prepared(data_cfg) -> dict:
    """The meta of `data_cfg.data_dir`, prepared first if it does not exist (or is empty; an unfinished
    preparation of the same settings resumes), then its files verified against their sha256. (The run's copy of
    the tokenizer is made once it has resumed: data_identity.keep_run_tokenizer.)

    A directory that holds anything else is refused with a DataFileError before any step, never rewritten: data
    prepared with another source, tokenizer (name or sha256), text_field, max_bytes or bpe_vocab_size (and, for
    the previous format, val_fraction), or no complete data at all. Call on one rank only (then barrier).
    """
    data_dir = Path(data_cfg.data_dir)
    meta, why = meta_and_reason(data_dir)
    if meta is None and data_dir.is_dir() and any(data_dir.iterdir()):
        raise DataFileError(f"data.data_dir={str(data_dir)!r} holds no complete prepared data ({why}), and a run "
                            f"never rewrites data it did not prepare: {prepare_again(data_dir)}.")
    bpe = trains_bpe(data_cfg.tokenizer)
    if meta is None:
        print(f"preparing data in {data_dir}: {why if data_dir.is_dir() else 'it does not exist yet'}",
              file=sys.stderr, flush=True)
        meta = prepare_data(data_cfg.source, data_cfg.tokenizer, data_dir, val_fraction=data_cfg.val_fraction,
                            max_bytes=data_cfg.max_bytes, text_field=data_cfg.text_field,
                            bpe_vocab_size=data_cfg.bpe_vocab_size, num_workers=data_cfg.num_workers,
                            shard_tokens=data_cfg.shard_tokens)
    else:
        identity = TokenizerIdentity.of_spec(data_cfg.tokenizer, data_dir)
        wanted = {**identity.meta_fields(), "source": source_key(data_cfg.source),
                  "max_bytes": data_cfg.max_bytes, "text_field": data_cfg.text_field,
                  "bpe_vocab_size": data_cfg.bpe_vocab_size if bpe else None}
        if is_previous_format(meta):  # it split train/val when it was prepared
            wanted["val_fraction"] = data_cfg.val_fraction
        refuse_other_settings(data_dir, meta, wanted)
        # on rank 0 first: it fills the hash cache that the other ranks then read
        verify_at_start(data_dir, meta, TokenizerIdentity.from_meta(meta).data_dir_files())
    return meta
