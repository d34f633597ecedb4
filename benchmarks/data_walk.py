"""The data walk, measured: the modules of parallel_attention.training that one batch passes through, from a
prepared data directory to the micro-batches the loss reads, in the order first entered, with the modules each is
entered from. One process, CPU, a small stdlib corpus.

Three walks: the preparation check (run_data.prepare_run_data: make sure the data directory exists and is the one
the config asks for; it reads no batch), the batch walk (run_data.open_run_sampler, then the first step's
micro-batches) and the same from a Megatron-LM prefix (a blend of one .bin + .idx pair). A return is entering a module again from another module than the one that first entered it: the
reader left it and comes back to it along another path. The trainer's own calls are not counted as callers.

    OMP_NUM_THREADS=1 python benchmarks/data_walk.py
"""

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from parallel_attention.training import ensure_prepared, load_config  # noqa: E402
from parallel_attention.training.data.read.run_data import open_run_sampler, prepare_run_data  # noqa: E402

WING = "parallel_attention.training"


def walk(steps) -> tuple[list[str], dict[str, list[str]]]:
    """(modules in the order first entered, {module: the modules it was entered from, in first-entered order})
    while `steps()` runs."""
    order, callers = [], {}

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if callee.startswith(WING) and callee != caller:
            order.append(callee) if callee not in order else None
            seen = callers.setdefault(callee, [])
            seen.append(caller) if caller not in seen and caller != __name__ else None

    sys.setprofile(profile)
    try:
        steps()
    finally:
        sys.setprofile(None)
    return order, callers


def report(title: str, order: list[str], callers: dict[str, list[str]]) -> None:
    short = lambda name: "(the trainer)" if name == "__main__" else name.removeprefix(WING + ".")  # noqa: E731
    print(f"{title}: {len(order)} modules, in the order first entered (<- the modules each is entered from):")
    for i, name in enumerate(order, 1):
        print(f"  {i:2d}. {short(name)}  <- {', '.join(short(c) for c in callers[name]) or '(the trainer)'}")
    again = [short(n) for n in order if len(callers[n]) > 1]
    returns = sum(max(len(callers[n]) - 1, 0) for n in order)
    print(f"  {returns} returns; {len(again)} modules entered from more than one: {', '.join(again) or 'none'}")


def walks(tmp: Path) -> dict[str, tuple[list[str], dict[str, list[str]]]]:
    """{title: walk} of the preparation check and the batch walk, on a small stdlib corpus prepared in `tmp`, and
    of the batch walk from a Megatron-LM prefix (a copy of that corpus's first shard)."""
    overrides = [f"--logging.run_dir={tmp / 'run'}", "--data.seq_len=32", "--model.max_seq_len=32"]
    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", [
        f"--data.data_dir={tmp / 'data'}", "--data.source=stdlib", "--data.max_bytes=40000", *overrides])
    meta = ensure_prepared(cfg.data)  # the data directory exists before either walk starts
    prefix = tmp / "megatron" / "corpus"
    prefix.parent.mkdir()
    for kind in ("bin", "idx"):
        shutil.copy(tmp / "data" / f"{meta['shards'][0]['prefix']}.{kind}", f"{prefix}.{kind}")
    megatron = load_config(ROOT / "configs" / "gpt_tiny.yaml", [f"--data.blend=[{{path: {prefix}, weight: 1}}]",
                                                               *overrides])

    def batch(config):
        sampler, _ = open_run_sampler(config)
        sampler.local_micro_batches(0, dp_rank=0, dp_size=1, micro_batch_size=config.training.micro_batch_size)

    return {"the preparation check": walk(lambda: prepare_run_data(cfg)), "the batch walk": walk(lambda: batch(cfg)),
            "the batch walk from a Megatron-LM prefix": walk(lambda: batch(megatron))}


def main() -> None:
    for title, (order, callers) in walks(Path(tempfile.mkdtemp())).items():
        report(title, order, callers)


if __name__ == "__main__":
    main()
