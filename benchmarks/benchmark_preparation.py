"""Data preparation, side by side: peak memory against corpus size, and the token rate against `tokenizers` alone.

    python benchmarks/benchmark_preparation.py --sizes-mb 64 256 --bpe-mb 64 --workers 2 --repeats 3

(a) memory: prepare_shards with byte tokens on jsonl corpora of each --sizes-mb, each run in a fresh process whose
    process tree's resident memory (every process summed) is sampled every 20 ms; the peak's median per size and
    the ratio of the largest to the smallest (streaming: it should stay near 1).
(b) rate: on --bpe-mb of jsonl, a BPE of 8192 tokens trained once on a sample (its tokenizer.json passed as the
    tokenizer, as a user with a trained tokenizer does): tokens per second of prepare_shards, and of the
    `tokenizers` library's own encode_batch over the same documents held in memory (no reading, no writing: the
    ceiling of any pipeline around it), both with --workers threads (RAYON_NUM_THREADS), each in a fresh process.

Corpora are written locally from this interpreter's standard library (files cut at random lengths, shuffled,
seeded), nothing downloaded. The two sides alternate within each repeat; medians and ratios are printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PREPARE = """
import sys, time
from parallel_attention.training.data.prepare.shards import prepare_shards
if __name__ == "__main__":
    start = time.perf_counter()
    meta = prepare_shards(sys.argv[1], sys.argv[2], sys.argv[3], max_bytes=None, num_workers=int(sys.argv[4]))
    print(meta["num_tokens"], time.perf_counter() - start)
"""
ENCODE_BATCH = """
import json, sys, time
from tokenizers import Tokenizer
if __name__ == "__main__":
    tokenizer = Tokenizer.from_file(sys.argv[2])
    with open(sys.argv[1], encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    start = time.perf_counter()
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    tokens = sum(len(e.ids) for e in encodings) + len(texts)  # + one end-of-text each, as prepared data holds
    print(tokens, time.perf_counter() - start)
"""


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> Path:
    """A jsonl file of about `megabytes` MB: standard-library sources cut at random lengths, in random order."""
    if path.is_file():
        return path
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [t for p in sorted(stdlib.glob("*.py")) if (t := p.read_text(encoding="utf-8", errors="ignore")).strip()]
    rng, size = random.Random(seed), 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".tmp"), "w", encoding="utf-8") as f:
        while size < megabytes * 1e6:
            text = rng.choice(texts)
            start = rng.randrange(len(text))
            line = json.dumps({"text": text[start:start + rng.randint(200, 8000)] or text}) + "\n"
            f.write(line)
            size += len(line)
    os.replace(path.with_suffix(".tmp"), path)
    return path


def tree_rss(pid: int) -> int:
    """Bytes resident in `pid` and its descendants, summed (psutil where installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        return _proc_tree_rss(pid)
    total = 0
    try:
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            total += process.memory_info().rss
    except psutil.Error:  # a process ended between the listing and the reading
        pass
    return total


def _proc_tree_rss(pid: int) -> int:
    parents, rss = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        child = int(stat.parent.name)
        parents[child], rss[child] = int(fields[1]), int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    tree, grew = {pid}, True
    while grew:
        grew = False
        for child, parent in parents.items():
            if parent in tree and child not in tree:
                tree.add(child)
                grew = True
    return sum(rss.get(p, 0) for p in tree)


def peak_tree_rss(command: list[str], env: dict) -> tuple[float, str]:
    """(peak MB of the resident memory of `command` and its children, summed, sampled every 20 ms; its stdout)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    peak = 0
    while process.poll() is None:
        peak = max(peak, tree_rss(process.pid))
        time.sleep(0.02)
    out = process.stdout.read()
    if process.returncode:
        raise RuntimeError(f"{command} exited with {process.returncode}")
    return peak / 1e6, out


def run(script: str, args: list, workers: int, scratch: Path) -> tuple[float, str]:
    file = scratch / ("prepare.py" if script is PREPARE else "encode_batch.py")
    file.write_text(script)
    env = {**os.environ, "RAYON_NUM_THREADS": str(workers), "TOKENIZERS_PARALLELISM": "true",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return peak_tree_rss([sys.executable, str(file), *map(str, args)], env)


def memory(scratch: Path, sizes: list[float], workers: int, repeats: int) -> dict:
    corpora = {size: write_corpus(scratch / f"corpus_{size:g}mb" / "a.jsonl", size).parent for size in sizes}
    peaks = {size: [] for size in sizes}
    for _ in range(repeats):
        for size in sizes:  # alternating sizes within a repeat
            peak, _ = run(PREPARE, [corpora[size], "byte", scratch / f"out_{size:g}", workers], workers, scratch)
            peaks[size].append(peak)
    medians = {f"{size:g} MB": statistics.median(p) for size, p in peaks.items()}
    return {"peak_mb": medians, "runs_mb": {f"{s:g} MB": p for s, p in peaks.items()},
            "ratio_largest_to_smallest": medians[f"{max(sizes):g} MB"] / medians[f"{min(sizes):g} MB"]}


def rate(scratch: Path, megabytes: float, workers: int, repeats: int) -> dict:
    from parallel_attention.training import train_bpe

    corpus = write_corpus(scratch / f"corpus_{megabytes:g}mb" / "a.jsonl", megabytes)
    tokenizer = scratch / "bpe" / "tokenizer.json"
    if not tokenizer.is_file():
        sample = write_corpus(scratch / "bpe_sample.jsonl", min(4.0, megabytes), seed=1)
        train_bpe((json.loads(line)["text"] for line in sample.open(encoding="utf-8")), 8192, tokenizer)
    ours, theirs = [], []
    for _ in range(repeats):
        _, out = run(PREPARE, [corpus.parent, tokenizer, scratch / "out_bpe", workers], workers, scratch)
        tokens, seconds = out.split()
        ours.append(int(tokens) / float(seconds))
        _, out = run(ENCODE_BATCH, [corpus, tokenizer], workers, scratch)
        tokens, seconds = out.split()
        theirs.append(int(tokens) / float(seconds))
    return {"prepare_tokens_per_s": statistics.median(ours), "encode_batch_tokens_per_s": statistics.median(theirs),
            "ratio": statistics.median(ours) / statistics.median(theirs),
            "paired_ratios": [o / t for o, t in zip(ours, theirs)]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[64, 256], help="corpora of (a) (default: %(default)s)")
    parser.add_argument("--bpe-mb", type=float, default=64, help="corpus of (b) (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="encoding threads (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side (default: %(default)s)")
    parser.add_argument("--scratch", type=Path, default=None, help="keeps the corpora between runs (default: a "
                                                                   "temporary directory)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = args.scratch or Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        result = {"workers": args.workers, "repeats": args.repeats,
                  "memory": memory(scratch, args.sizes_mb, args.workers, args.repeats),
                  "rate": rate(scratch, args.bpe_mb, args.workers, args.repeats)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
