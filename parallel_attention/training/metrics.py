"""What a run shows and leaves behind: progress on the console, metrics.jsonl, TensorBoard, loss.png.

Only global rank 0 creates a `MetricsLogger`; the other ranks stay silent. The console shows one
of two displays, chosen once at construction:

- `TqdmBar`: a tqdm progress bar (loss, tokens/s, ETA, TFLOP/s and MFU when records carry them), when
  `logging.progress_bar` is true and stderr is a terminal;
- `PlainLines`: one line per logged step, `[###---] step N/M loss X T tok/s ETA Ss [val V]`, otherwise
  (a log file, CI, tests and scripts parse these lines, so their format stays fixed).

A record's `tflops` is the achieved model TFLOP/s per device, `peak_tflops` the device peak it is measured
against and `mfu` = tflops / peak_tflops, the model FLOPs utilisation (0.42 = 42%), never above 1; `flops.py`
says what is counted and why a step faster than the peak raises it.

metrics.jsonl holds at most one row per step, each valid JSON: a non-finite value (a diverged loss)
is written as `null`. A run opened at step N (a fresh run at 0, a resumed one at its checkpoint's
step) first drops the rows it is about to write again, so a restart, or a fallback to an older
checkpoint, leaves no duplicate steps.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TextIO


def _extras(record: dict) -> list[str]:
    """Model TFLOP/s per device, MFU and validation loss, when the record has them, as
    `12.3 TFLOP/s` / `mfu 42.0%` / `val 2.3456`."""
    parts = []
    if "tflops" in record:
        parts.append(f"{record['tflops']:.3g} TFLOP/s")
    if "mfu" in record:
        parts.append(f"mfu {record['mfu']:.1%}")
    if "val_loss" in record:
        parts.append(f"val {record['val_loss']:.4f}")
    return parts


class PlainLines:
    """One line per logged step (and one for the initial evaluation), flushed at once."""

    def __init__(self, max_steps: int, start_step: int, stream: TextIO) -> None:
        self.max_steps, self.start_step, self.stream = max_steps, start_step, stream
        self.started = time.perf_counter()

    def show(self, record: dict) -> None:
        step = record["step"]
        done = step - self.start_step
        eta = (time.perf_counter() - self.started) / max(done, 1) * (self.max_steps - step)
        width = 30
        filled = int(width * step / self.max_steps)
        bar = "#" * filled + "-" * (width - filled)
        text = (f"[{bar}] step {step}/{self.max_steps} loss {record['loss']:.4f} "
                f"{record['tokens_per_s']:.0f} tok/s ETA {eta:5.0f}s")
        self.note(" ".join([text, *_extras(record)]))

    def note(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        pass


class TqdmBar:
    """A tqdm bar over the steps of this run: tqdm's ETA and rate, our loss, tokens/s and MFU."""

    def __init__(self, max_steps: int, start_step: int, stream: TextIO) -> None:
        try:
            from tqdm import tqdm
        except ImportError as error:
            raise ImportError("logging.progress_bar=true draws its bar with tqdm, which is not installed: "
                              "pip install tqdm, or set --logging.progress_bar=false.") from error
        self.stream = stream
        self.bar = tqdm(total=max_steps, initial=start_step, unit="step", desc="train", file=stream,
                        dynamic_ncols=True)

    def show(self, record: dict) -> None:
        parts = [f"loss {record['loss']:.4f}", f"{record['tokens_per_s']:.0f} tok/s", *_extras(record)]
        self.bar.set_postfix_str(", ".join(parts), refresh=False)
        self.bar.update(record["step"] - self.bar.n)
        self.bar.refresh()  # update() redraws at most every 0.1 s; a logged step is always shown

    def note(self, text: str) -> None:
        self.bar.write(text, file=self.stream)

    def close(self) -> None:
        self.bar.close()


class MetricsLogger:
    def __init__(self, run_dir: Path, max_steps: int, start_step: int, progress_bar: bool, tensorboard: bool):
        self.path = run_dir / "metrics.jsonl"
        display = TqdmBar if progress_bar and sys.stderr.isatty() else PlainLines
        self.display = display(max_steps, start_step, sys.stderr)
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional: pip install -e '.[tb]'
                SummaryWriter = None
            if SummaryWriter is not None:
                self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        keep_history(self.path, start_step)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict) -> None:
        """Append one step's record (flushed at once, so a killed run keeps its history), then show it."""
        self._file.write(json_line(record) + "\n")
        self._file.flush()
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, record["step"])
        if "loss" in record:
            self.display.show(record)
        else:  # the initial evaluation
            self.display.note(f"step {record['step']}: val loss {record['val_loss']:.4f}")

    def close(self) -> None:
        self.display.close()
        self._file.close()
        if self.writer is not None:
            self.writer.close()


def json_line(record: dict) -> str:
    """The record as strict JSON: non-finite floats (NaN, inf) become null."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(clean, allow_nan=False)


def keep_history(path: Path, start_step: int) -> None:
    """Rewrite metrics.jsonl with one row per step up to the step a run continues from.

    A run that continues after step N keeps rows 0..N; a fresh run (N = 0) keeps none, as it logs step 0
    again. The last row of a step wins, and a torn last line (a killed write) is dropped. The rewrite replaces
    the file: safe because only the run directory's lock holder (`run_lock`) ever writes it.
    """
    if not path.exists():
        return
    start_step = start_step if start_step > 0 else -1
    rows: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) and 0 <= record["step"] <= start_step:
                rows[record["step"]] = record
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json_line(rows[step]) + "\n" for step in sorted(rows))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metrics(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss(run_dir: Path) -> Path | None:
    """loss.png of train and validation loss against step, from metrics.jsonl; None, saying so, without matplotlib
    (a bare GPU image may lack it: the run's outputs stand without the picture)."""
    try:
        import matplotlib
    except ImportError:
        print(f"no loss.png in {run_dir}: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = {}
    for r in read_metrics(run_dir / "metrics.jsonl"):
        records[r["step"]] = {**records.get(r["step"], {}), **r}  # a resumed run may repeat steps
    steps = sorted(records)
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [s for s in steps if records[s].get("loss") is not None]  # null: a diverged step
    ax.plot(train, [records[s]["loss"] for s in train], label="train loss", linewidth=1)
    val = [s for s in steps if records[s].get("val_loss") is not None]
    ax.plot(val, [records[s]["val_loss"] for s in val], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    out = run_dir / "loss.png"
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out
