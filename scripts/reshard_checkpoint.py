"""Rewrite a checkpoint at another tensor-parallel size (weights and optimizer state), offline.

    python scripts/reshard_checkpoint.py --in runs/gpt_tiny --out runs/gpt_tiny_tp4 --tp 4 [--ep 2]

--in takes a step directory or a run directory (its newest complete checkpoint); the result is
written as OUT/checkpoints/step_XXXXXXX/, so `--resume` with --logging.run_dir=OUT continues it, with the run's
config.yaml (at the new size) and tokenizer/ beside it: OUT is a model directory of its own.
The canonical (p-independent) state dict is the pivot, so any p converts to any p' that divides the model. A
mixture of experts' checkpoint holds every expert whole at any ep: --ep sets only the expert_parallel_size the
copy's config runs at (default: the source's).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from parallel_attention.launch.warning_lines import one_line_warnings
from parallel_attention.checkpointing import reshard_checkpoint, resolve_step_dir
from parallel_attention.training.run.run_dir import carry_model_files


def main(argv: list[str]) -> int:
    one_line_warnings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in", dest="source", required=True, type=Path,
                        help="run directory (its newest complete checkpoint) or step_XXXXXXX directory")
    parser.add_argument("--out", required=True, type=Path, help="run directory to write into")
    parser.add_argument("--tp", required=True, type=int, help="target tensor_parallel_size")
    parser.add_argument("--ep", type=int, default=None, help="target expert_parallel_size (default: the source's)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        source = resolve_step_dir(args.source)  # CheckpointError is a ValueError
        written = reshard_checkpoint(source, args.out / "checkpoints", args.tp, args.ep)
        carried = carry_model_files(source.parent.parent, args.out, args.tp, args.ep)
    except ValueError as error:
        print(f"cannot reshard {args.source}: {error}", file=sys.stderr)
        return 2
    experts = f", expert_parallel_size={args.ep}" if args.ep is not None else ""
    print(f"{source} -> {written} (tensor_parallel_size={args.tp}{experts}) in {time.perf_counter() - started:.1f}s"
          + (f", with {', '.join(carried)}" if carried else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
