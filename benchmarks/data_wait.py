"""How long the steps of a finished run waited for their data: data_wait_s against the step time, from its files.

    python benchmarks/data_wait.py runs/quickstart

Reads RUN/metrics.jsonl (every logged step's `data_wait_s` and `tokens_per_s`) and RUN/config.yaml (tokens per
step = training.global_batch_size x data.seq_len, so a step took tokens / tokens_per_s seconds). Prints the median
wait, the median step, their ratio and the worst step's share as one JSON object. The first step has nothing
read ahead (the loader starts with it), so it is reported apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml


def wait_figures(run_dir: Path) -> dict:
    config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    tokens = config["training"]["global_batch_size"] * config["data"]["seq_len"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    rows = [r for r in rows if "data_wait_s" in r and r.get("tokens_per_s")]
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no step with data_wait_s: train with this release first.")
    first, later = rows[0], rows[1:] or rows
    waits, steps = [r["data_wait_s"] for r in later], [tokens / r["tokens_per_s"] for r in later]
    return {"steps": len(later), "median_wait_s": statistics.median(waits), "median_step_s": statistics.median(steps),
            "median_share": statistics.median(waits) / statistics.median(steps),
            "worst_share": max(w / s for w, s in zip(waits, steps)),
            "first_step": {"step": first["step"], "wait_s": first["data_wait_s"],
                           "share": first["data_wait_s"] / (tokens / first["tokens_per_s"])}}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a run directory (metrics.jsonl, config.yaml)")
    try:
        print(json.dumps(wait_figures(parser.parse_args(argv).run_dir), indent=1))
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
