"""Draw one step of a pipeline-parallel run: one row per stage, its forward (F), backward (B) and weight-gradient
(W, zero bubble only) blocks, its waits for a neighbour, and the host's time between actions, as every pipeline paper
draws a schedule, but measured in the run itself. Every colour is in the legend; a block's label shows where it fits.

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

# every colour the picture uses, with what it means; the legend lists those a step shows
KINDS = {
    "F": ("#4c72b0", "forward (F<micro-batch>[.<chunk>])"),
    "B": ("#55a868", "backward (B<micro-batch>[.<chunk>])"),
    "W": ("#dd8452", "weight gradient (W), deferred"),
    "wait": ("#b0b0b0", "wait: receiving from a neighbour stage"),
    "between": ("#e6c84f", "between actions: sends, the loss, bookkeeping"),
    "outside": ("#f2f2f2", "outside this stage's schedule (before its first or after its last action)"),
}
HATCH = {"outside": "////"}  # light, so hatched: never mistaken for an empty part of the row


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
    return label if label in KINDS else label[0]


def spans(records: list[dict]) -> list[tuple[int, str, str, float, float]]:
    """(stage, kind, label, start, end) in seconds from the step's start, covering every stage's row from the
    earliest start to the latest end: the recorded events, the time between them ("between") and the time before a
    stage's first and after its last event ("outside"), so no part of a row is left unexplained."""
    origin = min(r["start"] + r["events"][0][1] for r in records)
    end = max(r["start"] + r["events"][-1][2] for r in records) - origin
    out = []
    for r in records:
        at, started = 0.0, False
        for label, s, e in r["events"]:
            s, e = r["start"] + s - origin, r["start"] + e - origin
            if s > at:
                out.append((r["stage"], "between" if started else "outside", "", at, s))
            started = True
            out.append((r["stage"], kind(label), label if label != "wait" else "", s, e))
            at = max(at, e)
        if at < end:
            out.append((r["stage"], "outside", "", at, end))
    return out


def measured_bubble(records: list[dict]) -> float:
    start = min(r["start"] + r["events"][0][1] for r in records)
    end = max(r["start"] + r["events"][-1][2] for r in records)
    compute = sum(e - s for r in records for label, s, e in r["events"] if label != "wait")
    return 1 - compute / (len(records) * (end - start))


def chrome_trace(records: list[dict]) -> dict:
    events = [{"name": label or KINDS[k][1].split(":")[0], "cat": k, "ph": "X", "pid": 0, "tid": stage,
               "ts": start * 1e6, "dur": (end - start) * 1e6}
              for stage, k, label, start, end in spans(records) if k != "outside"]
    names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r["stage"], "args": {"name": f"stage {r['stage']}"}}
             for r in records]
    return {"traceEvents": names + events, "displayTimeUnit": "ms"}


def draw(records: list[dict], step: int, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(records, step)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure(records: list[dict], step: int):
    """The step's picture (a matplotlib Figure), its blocks labelled where the labels fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = spans(records)
    shown = [k for k in KINDS if any(d[1] == k for d in drawn)]  # W only where the schedule has one
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(records) + 1.6))
    for stage, k, _, start, end in drawn:
        ax.barh(stage, (end - start) * 1e3, left=start * 1e3, color=KINDS[k][0], linewidth=0, hatch=HATCH.get(k),
                edgecolor="#bbbbbb")
    ax.set_xlim(0, max(d[4] for d in drawn) * 1e3)
    ax.set_yticks([r["stage"] for r in records], [f"stage {r['stage']}" for r in records])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's start")
    ax.set_title(f"step {step}: measured bubble {measured_bubble(records):.3f} = 1 - compute / (stages x span)",
                 loc="left", fontsize=9)
    labels = [KINDS[k][1] + (" (input gradient only: W follows)" if k == "B" and "W" in shown else "") for k in shown]
    patches = [plt.Rectangle((0, 0), 1, 1, facecolor=KINDS[k][0], hatch=HATCH.get(k), edgecolor="#bbbbbb",
                             linewidth=0) for k in shown]
    fig.legend(patches, labels, loc="lower center",
               ncol=3, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(shown) > 3)), 1, 1))
    _label_blocks(fig, ax, drawn)
    return fig


def _label_blocks(fig, ax, drawn) -> None:
    """Each action's label inside its block, only where it fits: no label overlaps another or leaves its block."""
    renderer = fig.canvas.get_renderer()
    for stage, _, label, start, end in drawn:
        if not label:
            continue
        text = ax.text((start + end) * 5e2, stage, label, ha="center", va="center", fontsize=6, color="white")
        left, right = ax.transData.transform([(start * 1e3, stage), (end * 1e3, stage)])[:, 0]
        if text.get_window_extent(renderer).width > 0.9 * (right - left):
            text.remove()


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
