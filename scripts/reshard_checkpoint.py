"""Rewrite a checkpoint at another layout (tensor-parallel size, pipeline stages), weights and optimizer state,
offline.

    python scripts/reshard_checkpoint.py --in runs/gpt_tiny --out runs/gpt_tiny_tp4 --tp 4 [--ep 2]
    python scripts/reshard_checkpoint.py --in runs/gpt_tiny --out runs/gpt_tiny_pp2 --tp 1 --pp 2 --pipeline-layers 3,1

--in takes a step directory or a run directory (its newest complete checkpoint); the result is
written as OUT/checkpoints/step_XXXXXXX/, so `--resume` with --logging.run_dir=OUT continues it, with the run's
config.yaml (at the new layout: parallel.tensor_parallel_size and parallel.pipeline_*, the split explicit) and
tokenizer/ beside it: OUT is a model directory of its own. The canonical (layout-independent) state dict is the pivot,
so any layout converts to any other that divides the model. --pp 1 (the default) writes one stage. A mixture of
experts' checkpoint holds every expert whole at any ep: --ep sets only the expert_parallel_size the copy's config
runs at (default: the source's).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from parallel_attention.checkpointing import read_manifest, reshard_checkpoint, resolve_step_dir
from parallel_attention.checkpointing.compatibility import saved_model_config
from parallel_attention.launch.warning_lines import one_line_warnings
from parallel_attention.pipeline.layout import StageCosts, rank_stages
from parallel_attention.training.run.run_dir import carry_model_files


def _layers(text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer counts, e.g. 3,1") from None


def _stages(source: Path, args) -> list | None:
    """Every pipeline rank's stage at --pp x --virtual-stages (None at pp 1 without chunks), the split balanced by
    cost as a run would balance it unless --pipeline-layers gives it."""
    if args.pp == 1 and args.virtual_stages == 1 and args.pipeline_layers is None:
        return None
    if args.pp == 1:
        raise ValueError(f"--virtual-stages={args.virtual_stages} or --pipeline-layers need --pp > 1.")
    manifest = read_manifest(source, config_sections=("model", "data"))
    model = saved_model_config(manifest)
    costs = StageCosts.of(model, manifest["config"]["data"]["seq_len"])
    return rank_stages(model.num_layers, args.pp, args.virtual_stages, args.pipeline_layers, costs)


def main(argv: list[str]) -> int:
    one_line_warnings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in", dest="source", required=True, type=Path,
                        help="run directory (its newest complete checkpoint) or step_XXXXXXX directory")
    parser.add_argument("--out", required=True, type=Path, help="run directory to write into")
    parser.add_argument("--tp", required=True, type=int, help="target tensor_parallel_size")
    parser.add_argument("--pp", type=int, default=1, help="target pipeline_parallel_size (default 1)")
    parser.add_argument("--virtual-stages", type=int, default=1,
                        help="target virtual_pipeline_stages (model chunks per pipeline rank; default 1)")
    parser.add_argument("--pipeline-layers", type=_layers, default=None,
                        help="layers per virtual stage, e.g. 3,1 (default: balanced by cost, as a run splits)")
    parser.add_argument("--ep", type=int, default=None, help="target expert_parallel_size (default: the source's)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        source = resolve_step_dir(args.source)  # CheckpointError is a ValueError
        written = reshard_checkpoint(source, args.out / "checkpoints", args.tp, _stages(source, args), args.ep)
        parallel = read_manifest(written)["config"]["parallel"]
        carried = carry_model_files(source.parent.parent, args.out, {
            k: parallel[k] for k in ("tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_stages",
                                     "pipeline_layers", "pipeline_schedule", "expert_parallel_size", "zero_stage")
            if k in parallel})
    except ValueError as error:
        print(f"cannot reshard {args.source}: {error}", file=sys.stderr)
        return 2
    layout = f"tensor_parallel_size={args.tp}" + (
        f", pipeline_parallel_size={args.pp}, pipeline_layers={parallel['pipeline_layers']}" if args.pp > 1 else "") + (
        f", expert_parallel_size={args.ep}" if args.ep is not None else "")
    print(f"{source} -> {written} ({layout}) in {time.perf_counter() - started:.1f}s"
          + (f", with {', '.join(carried)}" if carried else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
