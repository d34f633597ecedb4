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
p / (lockstep/free). An upper bound: the free processes share the host, where a p = 1 run has it alone.
JSON: each pass per rank, the free and lockstep times per round (their slowest rank), the per-round ratios
(median, quartiles) and that ceiling.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import statistics
import sys
import time
from pathlib import Path

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
    for name in ("ranks", "rounds", "segments", "gemms", "timeout"):
        if getattr(args, name) < (2 if name == "ranks" else 1):
            parser.error(f"--{name}={getattr(args, name)}: give at least {2 if name == 'ranks' else 1}")
    return args


def quartiles(values: list[float]) -> dict:
    """_bench_training_timing.summary_ms's median and quartiles, restated: that module imports the library (and
    torch.distributed) into every spawned process, and this benchmark runs none of the library's code."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": median, "q1": q1, "q3": q3}


def _rank(rank: int, args: argparse.Namespace, start, barrier, results) -> None:
    """One process: per round, a free and a lockstep pass (the order alternating), each started together. A
    barrier that another rank never reaches raises here after --timeout, and the process exits non-zero."""
    import torch  # torch only where the work is: the parent merely counts

    torch.set_num_threads(1)
    a, b = (torch.randn(*shape) for shape in SHAPES)
    for round_index in range(args.rounds):
        for lockstep in (False, True) if round_index % 2 == 0 else (True, False):
            start.wait(args.timeout)
            began = time.perf_counter()
            for _ in range(args.segments):
                for _ in range(args.gemms):
                    torch.mm(a, b)
                if lockstep:
                    barrier.wait(args.timeout)
            results.put((round_index, lockstep, rank, time.perf_counter() - began))


def measure(args: argparse.Namespace) -> dict:
    context = mp.get_context("spawn")
    start, barrier, results = context.Barrier(args.ranks), context.Barrier(args.ranks), context.Queue()
    workers = [context.Process(target=_rank, args=(r, args, start, barrier, results), daemon=True)
               for r in range(args.ranks)]
    for worker in workers:
        worker.start()
    try:
        passes = _collect(workers, results, 2 * args.rounds * args.ranks, time.monotonic() + args.timeout)
    finally:
        for worker in workers:
            worker.kill()
    per_rank = {kind: [[passes[(i, kind == "lockstep", r)] for r in range(args.ranks)] for i in range(args.rounds)]
                for kind in ("free", "lockstep")}
    free, locked = ([max(ranks) for ranks in per_rank[kind]] for kind in ("free", "lockstep"))
    per_round = [lo / fr for lo, fr in zip(locked, free)]
    spread = quartiles(per_round)
    return {"ranks": args.ranks, "rounds": args.rounds, "segments": args.segments, "gemms": args.gemms,
            "segment_ms": statistics.median(free) / args.segments, "free_ms": free, "lockstep_ms": locked,
            "per_rank_ms": per_rank, "per_round": per_round, "lockstep_over_free": spread,
            "scaling_ceiling": args.ranks / spread["median"]}


def _collect(workers: list, results, count: int, deadline: float) -> dict:
    """(round, lockstep, rank) -> ms of each pass; a rank that dies or a run past the deadline is named."""
    passes = {}
    while len(passes) < count:
        try:
            round_index, lockstep, rank, seconds = results.get(timeout=1)
            passes[(round_index, lockstep, rank)] = seconds * 1e3
        except queue.Empty:
            dead = [r for r, worker in enumerate(workers) if worker.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"lockstep benchmark: rank(s) {dead} exited with "
                                 f"{[workers[r].exitcode for r in dead]}") from None
            if time.monotonic() > deadline:
                raise SystemExit(f"lockstep benchmark: {len(passes)} of {count} passes after --timeout") from None
    return passes


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
