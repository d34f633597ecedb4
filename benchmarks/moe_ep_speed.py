"""A mixture-of-experts model's training step at ep 2 against ep 1 for the same global batch, side by side: the
trainer itself (scripts/pretrain.py under torchrun), alternating the two layouts and repeating.

    python benchmarks/moe_ep_speed.py --rounds 3 --steps 8

ep 1 is one process that runs every expert on the whole global batch (8 sequences of 256 tokens as 2 micro-batches
of 4); ep 2 is two processes, data parallel 2 with the experts split over them (each runs its 4 sequences, half of
the experts, and the all-to-alls that bring each token to its expert and back; no ZeRO). The model: 4 layers, hidden 256,
every MLP a 16-expert top-2 SwiGLU MoE (each expert's FFN 256) with a load-balancing loss. A step's time is tokens
per step / tokens_per_s from metrics.jsonl, the median over the steps after the first two. The two layouts' losses
must agree step by step within 1e-5 (it exits naming the difference otherwise). Prints one JSON object: that worst
relative difference, how evenly the routing split the rows between ep 2's ranks, each layout's median step, every launch's, the ratio ep 2 / ep 1 of the medians and the median
of each round's ratio (the issue's limit 0.65; the ideal 0.5 plus the all-to-alls and the data-parallel all-reduce).
On a CPU each process takes one core: run it on an otherwise idle host with at least two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from pipeline_speed import launch

SEQ, BATCH = 256, 8
MODEL = ["--model.hidden_size=256", "--model.num_layers=4", "--model.num_heads=4", f"--model.max_seq_len={SEQ}",
         "--model.activation=swiglu", "--model.norm=rmsnorm", "--model.position_embedding=rotary",
         "--model.num_experts=16", "--model.moe_top_k=2", "--model.moe_ffn_hidden_size=256",
         "--model.moe_aux_loss_coeff=0.01", f"--data.seq_len={SEQ}", f"--training.global_batch_size={BATCH}",
         "--training.micro_batch_size=4", "--training.eval_interval=100000", "--training.eval_batches=1",
         "--checkpoint.interval=100000", "--logging.log_interval=1", "--logging.progress_bar=false",
         "--logging.tensorboard=false", "--parallel.tensor_parallel_size=1", "--parallel.zero_stage=0",
         "--checkpoint.resume=none", "--schedule.warmup_steps=1",  # ZeRO-1 (the default) would add its broadcasts
         # a router learning at 2e-3 collapses within 8 steps (one rank's experts get every row, the other waits):
         # a small rate keeps the routing near its even start, what the balancing loss aims at
         "--optimizer.lr=1e-5", "--optimizer.min_lr=1e-6"]
LAYOUTS = {"ep1": (1, ["--parallel.expert_parallel_size=1"]), "ep2": (2, ["--parallel.expert_parallel_size=2"])}
TOLERANCE = 1e-5  # float32: every layout trains like one process (tests/test_moe_training.py)


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def busiest_rank(run_dir: Path) -> float:
    """At ep 2, the busier rank's share of the routed rows over an even half (1: balanced, 2: one rank takes all),
    averaged over the logged steps and layers (metrics' moe_expert_load: each expert's share)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shares = [r[k] for r in rows for k in r if k.startswith("moe_expert_load/")]
    return round(statistics.mean(2 * max(sum(s[:len(s) // 2]), sum(s[len(s) // 2:])) for s in shares), 3)


def same_training(tmp: Path, rounds: int) -> float:
    """The worst relative difference of ep 2's losses from ep 1's, step by step, over every round (the two
    must train alike before their times mean anything)."""
    worst = 0.0
    for round_ in range(rounds):
        ep1, ep2 = losses(tmp / f"ep1_{round_}"), losses(tmp / f"ep2_{round_}")
        if len(ep1) != len(ep2) or not ep1:
            raise SystemExit(f"round {round_}: ep 1 logged {len(ep1)} losses, ep 2 {len(ep2)}")
        worst = max(worst, max(abs(a - b) / abs(a) for a, b in zip(ep1, ep2)))
    if worst > TOLERANCE:
        raise SystemExit(f"ep 2's losses differ from ep 1's by {worst:.3g} (> {TOLERANCE})")
    return worst


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = list(LAYOUTS) if round_ % 2 == 0 else list(reversed(LAYOUTS))  # the first one rotates
            for name in order:
                world, extra = LAYOUTS[name]
                times[name].append(launch(world, Path(tmp) / f"{name}_{round_}", args.steps, Path(tmp) / "data",
                                          extra, MODEL, BATCH * SEQ))
        worst, balance = same_training(Path(tmp), args.rounds), busiest_rank(Path(tmp) / "ep1_0")
    medians = {name: round(statistics.median(t), 4) for name, t in times.items()}
    paired = statistics.median(ep2 / ep1 for ep1, ep2 in zip(times["ep1"], times["ep2"]))
    print(json.dumps({"loss_worst_relative_difference": worst, "busiest_rank_load": balance, "step_s": medians,
                      "runs": times, "ep2_over_ep1": round(medians["ep2"] / medians["ep1"], 3),
                      "ep2_over_ep1_paired": round(paired, 3), "limit": 0.65, "ideal": 0.5}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
