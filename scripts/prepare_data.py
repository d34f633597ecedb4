"""Tokenize a corpus once into token files and meta.json for pretraining (docs/data.md).

    python scripts/prepare_data.py --source stdlib --tokenizer byte --out data/stdlib_byte
    python scripts/prepare_data.py --source path/to/corpus --tokenizer bpe --bpe-vocab-size 8192 --out data/corpus_bpe
    python scripts/prepare_data.py --source path/to/jsonl_dir --text-field content --tokenizer path/to/tokenizer_dir \
        --out data/corpus_hf

--source is "stdlib" (this interpreter's standard-library .py files), a file, a directory searched
recursively for text files (.txt, .md, .py, ...), .jsonl and .jsonl.gz (one document per line, field
--text-field) and .parquet (one per row, column --text-field; needs pyarrow), or a directory written by
Hugging Face datasets' save_to_disk (one document per row, column --text-field). --tokenizer is byte, gpt2 (tiktoken, cached
files only), bpe (a byte-level BPE trained on the corpus, saved as <out>/tokenizer.json) or a path to a
tokenizer.json or a directory holding one. --shard-tokens sets the tokens of each shard. A corpus is read whole
unless --max-bytes caps it (stdlib: 8 MB, as the quick start's config does). Run the same command
again after a kill and it resumes from the finished shards. The trainer prepares data itself when data_dir does
not exist; this script is for doing it ahead of time, e.g. once on a login node. It prints a summary, skipped
files and shards included. An --out that holds a dataset of another source or tokenizer, or other files, is
refused unless --overwrite.
"""

from __future__ import annotations

import argparse
import sys
import time

from parallel_attention.training import DataConfig
from parallel_attention.training import prepare_data

_WHOLE = object()  # --max-bytes not given: all of a corpus, the config's cap of stdlib


def _max_bytes(text: str) -> int | None:
    return None if text.lower() in ("none", "0", "all") else int(text)


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = DataConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=defaults.source,
                        help="'stdlib', a file, or a corpus directory (default: %(default)s)")
    parser.add_argument("--tokenizer", default=defaults.tokenizer,
                        help="byte | gpt2 | bpe | path to a tokenizer.json or a directory holding one "
                             "(default: %(default)s)")
    parser.add_argument("--out", default=defaults.data_dir, help="output directory (default: %(default)s)")
    parser.add_argument("--val-fraction", type=float, default=defaults.val_fraction,
                        help="share of the documents held out for validation (default: %(default)s)")
    parser.add_argument("--max-bytes", type=_max_bytes, default=_WHOLE,
                        help=f"cap on the bytes of text read ('none' for all; default: all of a corpus; "
                             f"{defaults.max_bytes} for stdlib, the quick start's)")
    parser.add_argument("--bpe-vocab-size", "--vocab-size", type=int, default=defaults.bpe_vocab_size,
                        help="tokens of the BPE that --tokenizer bpe trains (default: %(default)s)")
    parser.add_argument("--text-field", default=defaults.text_field,
                        help="text field of .jsonl / column of .parquet (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=defaults.num_workers,
                        help="tokenizing threads (0: one per CPU core, up to 8; default: %(default)s)")
    parser.add_argument("--shard-tokens", type=int, default=defaults.shard_tokens,
                        help="a shard closes once it holds this many tokens (default: %(default)s)")
    parser.add_argument("--skip-bad-files", action="store_true",
                        help="skip a truncated, corrupt or missing corpus file (counted in the summary and meta.json) "
                             "instead of refusing it")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace what --out holds (a dataset of another source or tokenizer, or other files), "
                             "which is refused without it")
    args = parser.parse_args(argv)
    if args.max_bytes is _WHOLE:  # the 8 MB cap keeps the quick start quick; a corpus of one's own is read whole
        args.max_bytes = defaults.max_bytes if args.source == "stdlib" else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    start = time.perf_counter()
    try:
        meta = prepare_data(args.source, args.tokenizer, args.out, val_fraction=args.val_fraction,
                            max_bytes=args.max_bytes, text_field=args.text_field,
                            bpe_vocab_size=args.bpe_vocab_size, num_workers=args.workers,
                            shard_tokens=args.shard_tokens, skip_bad_files=args.skip_bad_files,
                            overwrite=args.overwrite)
    except (ValueError, OSError) as error:  # bad source, tokenizer or settings: one line, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    print(f"prepared {args.out} from {meta['source']} with tokenizer {meta['tokenizer']} in {elapsed:.2f} s")
    print(f"  {meta['num_files']} files, {meta['num_documents']} documents, {meta['num_bytes']:,} bytes of text")
    print(f"  train {meta['num_train_tokens']:,} tokens, val {meta['num_val_tokens']:,} tokens "
          f"({meta['dtype']}, vocab {meta['vocab_size']}, eot {meta['eot_token']})")
    for reason, count in meta["skipped"].items():
        print(f"  skipped {count} {reason} (first: {meta['skipped_examples'][reason]})")
    if not meta["skipped"]:
        print("  nothing skipped")
    _print_shards(meta.get("shards"))
    return 0


def _print_shards(shards: list[dict] | None) -> None:
    """One line per shard (the first and last five of many)."""
    if not shards:
        return
    print(f"  {len(shards)} shards:")
    shown = shards if len(shards) <= 10 else [*shards[:5], None, *shards[-5:]]
    for shard in shown:
        print("    ..." if shard is None else f"    {shard['prefix']}.bin/.idx  {shard['num_documents']:,} documents, "
                                              f"{shard['num_tokens']:,} tokens")


if __name__ == "__main__":
    sys.exit(main())
