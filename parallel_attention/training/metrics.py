"""What a run shows and leaves behind: a progress line, metrics.jsonl, TensorBoard, loss.png.

Only global rank 0 creates a `MetricsLogger`; the other ranks stay silent.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: Path, max_steps: int, start_step: int, progress_bar: bool, tensorboard: bool):
        self.path = run_dir / "metrics.jsonl"
        self.max_steps, self.start_step = max_steps, start_step
        self.progress_bar = progress_bar
        self.started = time.perf_counter()
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict) -> None:
        """Append one step's record (flushed at once, so a killed run keeps its history)."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])
        self._show(record)

    def _show(self, record: dict) -> None:
        step = record["step"]
        if "loss" not in record:  # the initial evaluation
            sys.stderr.write(f"step {step}: val loss {record['val_loss']:.4f}\n")
            return
        done = step - self.start_step
        elapsed = time.perf_counter() - self.started
        eta = elapsed / max(done, 1) * (self.max_steps - step)
        width = 30
        filled = int(width * step / self.max_steps)
        bar = "#" * filled + "-" * (width - filled)
        text = (f"[{bar}] step {step}/{self.max_steps} loss {record['loss']:.4f} "
                f"{record['tokens_per_s']:.0f} tok/s ETA {eta:5.0f}s")
        if "val_loss" in record:
            text += f" val {record['val_loss']:.4f}"
        if self.progress_bar and sys.stderr.isatty():
            sys.stderr.write("\r" + text)
            if step >= self.max_steps:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        self._file.close()
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss(run_dir: Path) -> Path:
    """loss.png of train and validation loss against step, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = {}
    for r in read_metrics(run_dir / "metrics.jsonl"):
        records[r["step"]] = {**records.get(r["step"], {}), **r}  # a resumed run may repeat steps
    steps = sorted(records)
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [s for s in steps if "loss" in records[s]]
    ax.plot(train, [records[s]["loss"] for s in train], label="train loss", linewidth=1)
    val = [s for s in steps if "val_loss" in records[s]]
    ax.plot(val, [records[s]["val_loss"] for s in val], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    out = run_dir / "loss.png"
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out
