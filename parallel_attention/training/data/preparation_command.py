"""The prepare_data.py command that prepares a directory again as its meta.json says it was prepared.

A refusal's fix must reproduce the data as it was: a command that left out --text-field fails, and one that left
out --max-bytes prepares another amount of text (the script reads a whole corpus by default). So every setting
meta.json records becomes a flag; what it does not record (data prepared by an older release) keeps the default.
"""

from __future__ import annotations

import shlex

from ..tokenizer import trains_bpe

__all__ = ["preparation_command"]

# meta.json key -> prepare_data.py flag, in the order the command shows them
_FLAGS = (("source", "--source"), ("tokenizer", "--tokenizer"), ("bpe_vocab_size", "--bpe-vocab-size"),
          ("text_field", "--text-field"), ("max_bytes", "--max-bytes"), ("val_fraction", "--val-fraction"),
          ("shard_tokens", "--shard-tokens"))


def preparation_command(data_dir, meta: dict | None = None) -> str:
    """`python scripts/prepare_data.py ... --out DATA_DIR` with every setting `meta` records (SOURCE and TOKENIZER
    stand for what a missing meta.json cannot say; then --overwrite too, as what DATA_DIR holds is no dataset)."""
    args = ["python", "scripts/prepare_data.py"] + ([] if meta else ["--overwrite"])
    meta = meta or {}
    for key, flag in _FLAGS:
        if key == "bpe_vocab_size" and not trains_bpe(meta.get("tokenizer")):
            continue
        if key in meta:
            value = meta[key]
            args += [flag, "none" if value is None else str(value)]
        elif key in ("source", "tokenizer"):
            args += [flag, key.upper()]
    if meta.get("skip_bad_files"):
        args.append("--skip-bad-files")
    return " ".join(shlex.quote(a) if a not in ("SOURCE", "TOKENIZER") else a for a in args + ["--out", str(data_dir)])
