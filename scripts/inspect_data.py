"""Say what every sample of some steps of a run reads, without training: the trainer's own data code.

    python scripts/inspect_data.py --config configs/quickstart.yaml --steps 0:3
    python scripts/inspect_data.py --config my_run.yaml --data.seq_len=2048 --steps 1200:1201 --json --text

For each row of each global batch of steps A..B-1: `step`, `row` (its index in the global batch), `source` (the
data.blend path, as the config writes it; data.data_dir for a blend of one), `document` (the index in that source
of the document its first token belongs to), `offset` (that token's index in the source's training token stream),
and with --tokens its seq_len + 1 tokens, with --text their text. --json prints one JSON object per line with
exactly these keys. The config is validated as pretrain.py validates it (a refusal is the same `config error:`
line, exit 2). The data must be prepared already (a run or scripts/prepare_data.py does it); nothing is
written. A run started before data.sampling existed (its newest checkpoint's config has none) is shown with the
batches it keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from parallel_attention.launch.warning_lines import one_line_warnings
from parallel_attention import load_config
from parallel_attention.training.config.loading import parse_with_overrides
from parallel_attention.training.data.read.step_records import blend_names, open_run_data, step_records
from parallel_attention.training.data.token_files import REFUSALS


def _steps(text: str) -> range:
    first, sep, last = text.partition(":")
    try:
        steps = range(int(first), int(last) if sep else int(first) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps {text!r} must be A:B (steps A to B-1) or A") from None
    if steps.start < 0 or not steps:
        raise argparse.ArgumentTypeError(f"--steps {text!r} names no step: give A:B with 0 <= A < B")
    return steps


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/gpt_tiny.yaml", help="YAML config (default: %(default)s)")
    parser.add_argument("--steps", type=_steps, required=True, help="A:B, the steps A to B-1 (or one step A)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--tokens", action="store_true", help="each sample's tokens")
    parser.add_argument("--text", action="store_true", help="each sample's text, decoded")
    return parse_with_overrides(parser, argv)


def _world_size(cfg) -> int:
    """The world the config is checked against, as pretrain.py checks it: torchrun's WORLD_SIZE, else the
    smallest its layout allows (one data-parallel rank): a run's batches do not depend on it."""
    p = cfg.parallel
    layout = p.tensor_parallel_size * p.context_parallel_size * p.pipeline_parallel_size
    return int(os.environ.get("WORLD_SIZE", layout))


def main(argv: list[str]) -> int:
    one_line_warnings()
    args, overrides = parse_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        cfg.validate(_world_size(cfg))
    except (ValueError, OSError) as error:  # what pretrain.py refuses, in its words
        print(f"config error: {error}", file=sys.stderr)
        return 2
    try:
        sampler, tokenizer = open_run_data(cfg)
        names = blend_names(cfg)
        for step in args.steps:
            for record in step_records(sampler, step, names, tokens=args.tokens,
                                       tokenizer=tokenizer if args.text else None):
                print(json.dumps(record) if args.json else " ".join(f"{k} {v!r}" if k == "text" else f"{k} {v}"
                                                                    for k, v in record.items()))
    except BrokenPipeError:  # the reader (| head) has had enough
        return 0
    except REFUSALS as error:  # a bad config or data: one line, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
