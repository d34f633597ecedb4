"""Draw one step of a pipeline-parallel run: one row per stage, its forward (F), backward (B) and weight-gradient
(W) blocks and its waits, as every pipeline paper draws a schedule, but measured in the run itself.

    python scripts/pipeline_timeline.py runs/my_pp_run --step 10

Reads RUN/pipeline_timeline/stage<s>.jsonl (written by the trainer on logged steps: step 1 and every
logging.log_interval) and writes RUN/pipeline_timeline/step_<N>.png and step_<N>.trace.json (a Chrome trace: open it
in chrome://tracing or https://ui.perfetto.dev). Prints the measured bubble of the step. Needs no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452", "wait": "#d0d0d0"}


def read_step(run_dir: Path, step: int) -> list[dict]:
    """Every stage's record of `step`, by stage; a clear error naming what is there otherwise."""
    folder = run_dir / "pipeline_timeline"
    files = sorted(folder.glob("stage*.jsonl"))
    if not files:
        raise SystemExit(f"{folder} holds no stage*.jsonl: is {run_dir} a run with parallel.pipeline_parallel_size > 1 "
                         "(written on step 1 and every logging.log_interval steps)?")
    found, steps = [], set()
    for path in files:
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            steps.add(record["step"])
            if record["step"] == step:
                found = [r for r in found if r["stage"] != record["stage"]] + [record]  # a resumed run: the last
    if not found:
        raise SystemExit(f"step {step} was not recorded; recorded steps: {sorted(steps)}.")
    return sorted(found, key=lambda r: r["stage"])


def kind(label: str) -> str:
    return "wait" if label == "wait" else label[0]


def measured_bubble(records: list[dict]) -> float:
    start = min(r["start"] + r["events"][0][1] for r in records)
    end = max(r["start"] + r["events"][-1][2] for r in records)
    compute = sum(e - s for r in records for label, s, e in r["events"] if label != "wait")
    return 1 - compute / (len(records) * (end - start))


def chrome_trace(records: list[dict]) -> dict:
    origin = min(r["start"] for r in records)
    events = [{"name": label, "cat": kind(label), "ph": "X", "pid": 0, "tid": r["stage"],
               "ts": (r["start"] - origin + s) * 1e6, "dur": (e - s) * 1e6}
              for r in records for label, s, e in r["events"]]
    names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r["stage"], "args": {"name": f"stage {r['stage']}"}}
             for r in records]
    return {"traceEvents": names + events, "displayTimeUnit": "ms"}


def draw(records: list[dict], step: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min(r["start"] for r in records)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(records) + 1.2))
    for r in records:
        for label, s, e in r["events"]:
            x = (r["start"] - origin + s) * 1e3
            ax.barh(r["stage"], (e - s) * 1e3, left=x, color=COLOURS[kind(label)], edgecolor="white", linewidth=0.5)
            if label != "wait" and (e - s) * 1e3 > 0:
                ax.text(x + (e - s) * 5e2, r["stage"], label, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks([r["stage"] for r in records], [f"stage {r['stage']}" for r in records])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, ["forward", "backward", "weight gradient", "wait"], loc="lower right",
              bbox_to_anchor=(1.0, 1.0), ncol=4, fontsize=7, frameon=False)
    ax.set_title(f"step {step}: measured bubble {measured_bubble(records):.3f}", loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run directory (logging.run_dir)")
    parser.add_argument("--step", type=int, required=True, help="a recorded step (1, and every log_interval)")
    args = parser.parse_args(argv)
    records = read_step(args.run_dir, args.step)
    folder = args.run_dir / "pipeline_timeline"
    (folder / f"step_{args.step}.trace.json").write_text(json.dumps(chrome_trace(records)), encoding="utf-8")
    draw(records, args.step, folder / f"step_{args.step}.png")
    print(f"step {args.step}: {len(records)} stages, measured bubble {measured_bubble(records):.3f}; wrote "
          f"{folder / f'step_{args.step}.png'} and {folder / f'step_{args.step}.trace.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
