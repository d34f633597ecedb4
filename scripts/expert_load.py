"""Draw each MoE layer's expert load over the steps of a run: the picture MoE papers draw, from the run's own metrics.

    python scripts/expert_load.py runs/moe_tiny

Reads RUN/metrics.jsonl (each logged step's `moe_expert_load/<layer>`: every expert's share of the tokens routed in
that layer, the step's mean over its micro-batches) and writes RUN/expert_load.png: one heatmap per MoE layer, experts
down, logged steps across, the colour each expert's share relative to a perfectly balanced 1/E (1: balanced). Prints
each layer's most loaded expert at the last logged step. Needs no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PREFIX = "moe_expert_load/"


def read_loads(run_dir: Path) -> tuple[list[int], dict[int, list[list[float]]]]:
    """(logged steps, {layer: [each step's shares]}) from RUN/metrics.jsonl; a clear error when there are none."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: pass a run directory (logging.run_dir).")
    steps, loads = [], {}
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        layers = {int(k[len(PREFIX):]): v for k, v in record.items() if k.startswith(PREFIX)}
        if not layers:
            continue
        steps.append(record["step"])
        for layer, shares in layers.items():
            loads.setdefault(layer, []).append(shares)
    if not steps:
        raise SystemExit(f"{path} holds no {PREFIX}<layer> entries: is {run_dir} a run with model.num_experts > 0?")
    return steps, dict(sorted(loads.items()))


def draw(steps: list[int], loads: dict[int, list[list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(loads), 1, figsize=(10, 1.2 + 1.6 * len(loads)), squeeze=False)
    for ax, (layer, shares) in zip(axes[:, 0], loads.items()):
        experts = len(shares[0])
        relative = [[share * experts for share in row] for row in zip(*shares)]  # [expert][step], 1 = balanced
        image = ax.imshow(relative, aspect="auto", cmap="magma", vmin=0, interpolation="nearest",
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, experts - 0.5, -0.5))
        ax.set_ylabel(f"layer {layer}\nexpert")
        fig.colorbar(image, ax=ax, label="load x E")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle("tokens routed to each expert, relative to a balanced share")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the run directory (logging.run_dir)")
    args = parser.parse_args(argv)
    steps, loads = read_loads(args.run)
    draw(steps, loads, args.run / "expert_load.png")
    for layer, shares in loads.items():
        last = shares[-1]
        busiest = max(range(len(last)), key=last.__getitem__)
        print(f"layer {layer}: at step {steps[-1]} expert {busiest} takes {last[busiest]:.1%} of the routed tokens "
              f"({last[busiest] * len(last):.2f}x a balanced share)")
    print(f"wrote {args.run / 'expert_load.png'} ({len(steps)} logged steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
