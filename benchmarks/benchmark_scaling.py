"""How the training step scales with the tensor-parallel size, measured in one run of alternating launches.

    OMP_NUM_THREADS=1 python benchmarks/benchmark_scaling.py --config FILE [--section.key=value ...] \
        [--sizes 1,2] [--rounds 6] [--iters 6] [--warmup 2] --out OUT.json

Why a script of its own: a p = 1 and a p = 2 step cannot be timed in one process pair (the tensor-parallel
size is fixed when a run is built), and on a shared host the throughput drifts by 10-20 % between runs
minutes apart. So each round launches benchmarks/benchmark_training.py once per size, back to back
(`torchrun --standalone --nproc-per-node p`, data-parallel size 1, `--no-baselines --no-variants`), and the
order of the sizes rotates from round to round. The scaling from the first size p0 to p in round i is
step_ms(p0, round i) / step_ms(p, round i): two runs next to each other in time. The global batch is the
same at every size, so it is also the ratio of the tokens per second.

JSON: sizes, order (the sizes' launch order in each round), step_ms (size -> each round's median step),
scaling (size -> per_round, median, q1, q3 of the per-round ratios, and ratio_of_medians), the command of
each launch, and the resolved config of the first. Each launch's JSON and log lie in OUT.json.runs/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from _bench_training_timing import summary_ms

SCRIPT = Path(__file__).resolve().parent / "benchmark_training.py"
RESERVED = ("--parallel.tensor_parallel_size=", "--logging.run_dir=")  # set per launch by this script


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config, as pretrain.py reads it")
    parser.add_argument("--out", required=True, help="where the JSON goes")
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, the first the reference "
                                                       "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=6, help="launches per size (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=6, help="timed steps per launch (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch (default: %(default)s)")
    args, overrides = parser.parse_known_args(argv)
    try:
        args.sizes = [int(size) for size in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes={args.sizes!r}: give tensor-parallel sizes separated by commas, such as 1,2")
    if len(args.sizes) < 2 or len(set(args.sizes)) != len(args.sizes) or min(args.sizes) < 1:
        parser.error(f"--sizes={args.sizes}: give two or more different positive sizes, such as 1,2")
    if args.rounds < 1 or args.iters < 1 or args.warmup < 0:
        parser.error(f"--rounds={args.rounds} and --iters={args.iters} must be >= 1, --warmup={args.warmup} >= 0")
    bad = [o for o in overrides if not (o.startswith("--") and "=" in o) or o.startswith(RESERVED)]
    if bad:
        parser.error(f"unrecognised arguments {bad}: overrides look like --section.key=value, and this script "
                     "sets the tensor-parallel size (--sizes) and the run directory itself")
    return args, overrides


def launch_order(sizes: list[int], round_index: int) -> list[int]:
    """The sizes rotated by the round: each size runs first in turn, so no size always follows another."""
    shift = round_index % len(sizes)
    return sizes[shift:] + sizes[:shift]


def launch(args: argparse.Namespace, overrides: list[str], size: int, out: Path) -> tuple[list[str], dict]:
    """One benchmark_training.py run at tensor-parallel size `size`; its command and JSON."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={size}",
               str(SCRIPT), "--config", args.config, *overrides, f"--parallel.tensor_parallel_size={size}",
               f"--logging.run_dir={out}.run", "--no-baselines", "--no-variants", "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--out", str(out)]
    log = out.with_suffix(".log")
    with open(log, "w", encoding="utf-8") as f:
        code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    if code != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-4000:]
        raise SystemExit(f"the launch at tensor-parallel size {size} exited with {code} (log {log}):\n{tail}")
    return command, json.loads(out.read_text(encoding="utf-8"))


def scaling(step_ms: dict[int, list[float]], reference: int) -> dict[int, dict]:
    """size -> the per-round ratios reference/size, their median and quartiles, and the ratio of the medians."""
    result = {}
    for size, times in step_ms.items():
        if size == reference:
            continue
        ratios = [ref / ms for ref, ms in zip(step_ms[reference], times, strict=True)]
        spread = summary_ms(ratios)  # the step times' statistics (median, quartiles), here of ratios
        result[size] = {"per_round": ratios, **{key: spread[key] for key in ("median", "q1", "q3")},
                        "ratio_of_medians": statistics.median(step_ms[reference]) / statistics.median(times)}
    return result


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    runs = Path(f"{args.out}.runs")
    runs.mkdir(parents=True, exist_ok=True)
    step_ms = {size: [] for size in args.sizes}
    order, commands, config = [], [], None
    for round_index in range(args.rounds):
        order.append(launch_order(args.sizes, round_index))
        for size in order[-1]:
            command, result = launch(args, overrides, size, runs / f"round{round_index}_p{size}.json")
            step_ms[size].append(result["step_ms"]["median"])
            commands.append(command)
            config = config or result["config"]
        print(f"round {round_index + 1}/{args.rounds}: "
              + ", ".join(f"p = {size} {step_ms[size][-1]:.1f} ms" for size in args.sizes), file=sys.stderr)
    summary = {"sizes": args.sizes, "order": order, "step_ms": step_ms,
               "scaling": scaling(step_ms, args.sizes[0]), "commands": commands, "config": config}
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    for size, s in summary["scaling"].items():
        print(f"p = {args.sizes[0]} -> {size}: {s['median']:.3f}x median of {args.rounds} rounds "
              f"(IQR {s['q1']:.3f}-{s['q3']:.3f}), ratio of medians {s['ratio_of_medians']:.3f}x", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
