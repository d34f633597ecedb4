"""The data walk, measured: the modules of parallel_attention.training that one batch passes through, from a
prepared data directory to the micro-batches the loss reads, in the order first entered, with the modules each is
entered from (one entered from several is a file a reader returns to). One process, CPU, a small stdlib corpus.

    OMP_NUM_THREADS=1 python benchmarks/data_walk.py
"""

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from parallel_attention.training import ensure_prepared, load_config  # noqa: E402
from parallel_attention.training.data.read.run_data import build_data  # noqa: E402

WING = "parallel_attention.training"


def walk(cfg) -> tuple[list[str], dict[str, set[str]]]:
    """(modules in the order first entered, {module: the modules it was entered from}) for build_data and the first
    step's micro-batches."""
    order, callers = [], {}

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if callee.startswith(WING) and callee != caller:
            order.append(callee) if callee not in order else None
            callers.setdefault(callee, set()).add(caller)

    sys.setprofile(profile)
    try:
        sampler, _ = build_data(cfg)
        sampler.local_micro_batches(0, dp_rank=0, dp_size=1, micro_batch_size=cfg.training.micro_batch_size)
    finally:
        sys.setprofile(None)
    return order, callers


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", [
        f"--data.data_dir={tmp / 'data'}", "--data.source=stdlib", "--data.max_bytes=40000",
        f"--logging.run_dir={tmp / 'run'}", "--data.seq_len=32", "--model.max_seq_len=32"])
    ensure_prepared(cfg.data)  # the data directory exists before the walk starts
    order, callers = walk(cfg)
    short = lambda name: "(the trainer)" if name == "__main__" else name.removeprefix(WING + ".")  # noqa: E731
    print(f"{len(order)} modules, in the order first entered (<- the modules each is entered from):")
    for i, name in enumerate(order, 1):
        print(f"  {i:2d}. {short(name)}  <- {', '.join(sorted(short(c) for c in callers[name]))}")
    again = [short(n) for n in order if len(callers[n] - {"__main__"}) > 1]
    print(f"{len(again)} entered from more than one module (returns): {', '.join(again)}")


if __name__ == "__main__":
    main()
