"""What running in lockstep costs on this host, with none of the project's code: the ceiling that the host's own
per-core jitter puts on tensor-parallel scaling.

    python scripts/benchmark_lockstep.py [--ranks 2] [--rounds 10] [--segments 40] [--gemms 5] --out OUT.json

Why: a tensor-parallel rank cannot run ahead of the others past a blocking all-reduce, so a step goes at the pace
of the slowest core between every two collectives. On shared vCPUs one core can run 10-30 % slower than the
other for a while (a busy neighbour on the physical core; steal time does not show it). Here `--ranks` processes,
one thread each, run the same GEMM segments (`--gemms` [1024, 512] x [512, 768] products each) twice per round,
in alternating order: free-running, and with a barrier after every segment, which is what a TP collective
forces. Each pass is timed as its slowest process (a step ends when every rank is done).

lockstep/free per round near 1.00 means the cores keep pace; above it, that factor comes off any lockstep job's
scaling: with identical, perfectly divided work and no communication at all, p ranks scale by at most
p / (lockstep/free). JSON: the free and lockstep times per round, their per-round ratios (median, quartiles)
and that ceiling.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

from _bench_training_timing import summary_ms

SHAPES = ((1024, 512), (512, 768))  # a p = 2 QKV projection of the Llama benchmark config: h 512, s 512, b 2


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where the JSON goes")
    parser.add_argument("--ranks", type=int, default=2, help="processes, one thread each (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=10, help="paired passes (default: %(default)s)")
    parser.add_argument("--segments", type=int, default=40, help="segments per pass (default: %(default)s)")
    parser.add_argument("--gemms", type=int, default=5, help="GEMMs per segment (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the whole run (default: %(default)s)")
    args = parser.parse_args(argv)
    for name in ("ranks", "rounds", "segments", "gemms"):
        if getattr(args, name) < (2 if name == "ranks" else 1):
            parser.error(f"--{name}={getattr(args, name)}: give at least {2 if name == 'ranks' else 1}")
    return args


def _rank(rank: int, args: argparse.Namespace, start, barrier, results) -> None:
    """One process: per round, a free and a lockstep pass (the order alternating), each started together."""
    import torch  # in the child: spawn imports this module afresh

    torch.set_num_threads(1)
    a, b = (torch.randn(*shape) for shape in SHAPES)
    for round_index in range(args.rounds):
        for lockstep in (False, True) if round_index % 2 == 0 else (True, False):
            start.wait()
            began = time.perf_counter()
            for _ in range(args.segments):
                for _ in range(args.gemms):
                    torch.mm(a, b)
                if lockstep:
                    barrier.wait()
            results.put((round_index, lockstep, rank, time.perf_counter() - began))


def measure(args: argparse.Namespace) -> dict:
    context = mp.get_context("spawn")
    start, barrier, results = context.Barrier(args.ranks), context.Barrier(args.ranks), context.Queue()
    workers = [context.Process(target=_rank, args=(r, args, start, barrier, results)) for r in range(args.ranks)]
    for worker in workers:
        worker.start()
    deadline, passes = time.monotonic() + args.timeout, {}
    try:
        for _ in range(2 * args.rounds * args.ranks):
            round_index, lockstep, _, seconds = results.get(timeout=max(deadline - time.monotonic(), 1))
            passes.setdefault((round_index, lockstep), []).append(seconds * 1e3)
    finally:
        for worker in workers:
            worker.join(timeout=5)
            worker.kill()
    free = [max(passes[(i, False)]) for i in range(args.rounds)]
    locked = [max(passes[(i, True)]) for i in range(args.rounds)]
    per_round = [lo / fr for lo, fr in zip(locked, free)]
    spread = summary_ms(per_round)  # the step-time statistics, here of ratios
    return {"ranks": args.ranks, "rounds": args.rounds, "segments": args.segments, "gemms": args.gemms,
            "segment_ms": summary_ms(free)["median"] / args.segments, "free_ms": free, "lockstep_ms": locked,
            "per_round": per_round, "lockstep_over_free": {key: spread[key] for key in ("median", "q1", "q3")},
            "scaling_ceiling": args.ranks / spread["median"]}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    result = measure(args)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    spread = result["lockstep_over_free"]
    print(f"segments of {result['segment_ms']:.1f} ms: lockstep/free {spread['median']:.3f} (IQR {spread['q1']:.3f}-"
          f"{spread['q3']:.3f}) over {args.rounds} rounds; {args.ranks} ranks in lockstep scale by at most "
          f"{result['scaling_ceiling']:.2f}x on this host", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
