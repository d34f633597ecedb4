"""A real model's step at pp 2 against pp 1, side by side: the trainer itself (scripts/pretrain.py under torchrun),
one process per stage, alternating the two layouts and repeating.

    python benchmarks/pipeline_speed.py --rounds 3 --steps 8

Each launch trains --steps steps of a 8-layer model (hidden 256, 256-token sequences, 8 micro-batches of one
sequence a step) on the stdlib corpus; a step's time is tokens per step / tokens_per_s from metrics.jsonl, the
median over the steps after the first two. Prints one JSON object: each layout's median step and the ratio
pp 2 / pp 1 (1f1b's ideal with 8 micro-batches: (m + p - 1) / (m p) = 0.5625), with the schedule given.
On a CPU each process takes one core: run it on an otherwise idle host with at least two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--model.hidden_size=256", "--model.num_layers=8", "--model.num_heads=8", "--model.max_seq_len=256",
         "--data.seq_len=256", "--training.global_batch_size=8", "--training.micro_batch_size=1",
         "--training.eval_interval=100000", "--training.eval_batches=1", "--checkpoint.interval=100000",
         "--logging.log_interval=1", "--logging.progress_bar=false", "--logging.tensorboard=false",
         "--parallel.tensor_parallel_size=1", "--checkpoint.resume=none", "--schedule.warmup_steps=1"]


def step_seconds(run_dir: Path, tokens_per_step: int) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [tokens_per_step / r["tokens_per_s"] for r in rows if r.get("tokens_per_s")]
    return statistics.median(times[2:] or times)


def launch(world: int, run_dir: Path, steps: int, data_dir: Path, extra: list[str], model: list[str] = MODEL,
           tokens_per_step: int = 8 * 256) -> float:
    """The median step (s) of pretrain.py on gpt_tiny.yaml with `model` and `extra` overrides, one thread a rank."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               str(ROOT / "scripts" / "pretrain.py"), "--config", str(ROOT / "configs" / "gpt_tiny.yaml"), *model,
               f"--training.max_steps={steps}", f"--logging.run_dir={run_dir}", f"--data.data_dir={data_dir}",
               *extra]
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   timeout=1800)
    return step_seconds(run_dir, tokens_per_step)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args(argv)
    layouts = {"pp1": (1, []), "pp2": (2, ["--parallel.pipeline_parallel_size=2",
                                           f"--parallel.pipeline_schedule={args.schedule}"])}
    times: dict[str, list[float]] = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, (world, extra) in layouts.items():  # alternated, so drifting load hits both alike
                times[name].append(launch(world, Path(tmp) / f"{name}_{round_}", args.steps, Path(tmp) / "data",
                                          extra))
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({"schedule": args.schedule, "step_s": medians, "runs": times,
                      "ratio_pp2_over_pp1": round(medians["pp2"] / medians["pp1"], 3), "ideal": 0.5625}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
