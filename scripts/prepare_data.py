"""Tokenize a corpus once into train.bin / val.bin / meta.json for pretraining.

    python scripts/prepare_data.py --source stdlib --tokenizer byte --out data/stdlib_byte
    python scripts/prepare_data.py --source path/to/corpus --tokenizer gpt2 --out data/corpus_gpt2

--source is "stdlib" (this interpreter's standard-library .py files) or a .txt / .jsonl file or a
directory of them. The trainer prepares data itself when data_dir lacks it; this script is for
doing it ahead of time, e.g. once on a login node.
"""

from __future__ import annotations

import argparse
import time

from parallel_attention.training import DataConfig
from parallel_attention.training import prepare_data


def _max_bytes(text: str) -> int | None:
    return None if text.lower() in ("none", "0", "all") else int(text)


def main() -> None:
    defaults = DataConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=defaults.source, help="'stdlib' or a .txt/.jsonl file or directory")
    parser.add_argument("--tokenizer", default=defaults.tokenizer, choices=["byte", "gpt2"])
    parser.add_argument("--out", default=defaults.data_dir, help="output directory")
    parser.add_argument("--val-fraction", type=float, default=defaults.val_fraction)
    parser.add_argument("--max-bytes", type=_max_bytes, default=defaults.max_bytes,
                        help="cap on the bytes of text read ('none' for all)")
    args = parser.parse_args()

    start = time.perf_counter()
    meta = prepare_data(args.source, args.tokenizer, args.out, val_fraction=args.val_fraction,
                        max_bytes=args.max_bytes)
    elapsed = time.perf_counter() - start
    print(f"prepared {args.out} from {meta['source']} with tokenizer {meta['tokenizer']} in {elapsed:.2f} s")
    print(f"  {meta['num_files']} files, {meta['num_documents']} documents, {meta['num_bytes']:,} bytes of text")
    print(f"  train {meta['num_train_tokens']:,} tokens, val {meta['num_val_tokens']:,} tokens "
          f"({meta['dtype']}, vocab {meta['vocab_size']}, eot {meta['eot_token']})")


if __name__ == "__main__":
    main()
