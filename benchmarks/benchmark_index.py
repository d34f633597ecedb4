"""Opening a Megatron-LM prefix, side by side: peak memory and start-up against the number of documents.

    python benchmarks/benchmark_index.py --docs 2e6 8e6 --repeats 3 --dir /tmp/index_bench
    python benchmarks/benchmark_index.py --docs 2e6 8e6 --code /path/to/another/checkout   # the same on other code
    python benchmarks/benchmark_index.py --prepared-gb 4 --steps 4 --dir /tmp/index_bench        # (b) below

For each --docs count a synthetic prefix is written once (documents of 2..13 byte tokens, uint16, so the corpus is
small and the per-document index dominates). Then scripts/inspect_data.py, the trainer's own data path, says what
step 0 read, in a fresh process each time: the first start (which builds the index cache under a fresh
data.index_cache) and --repeats later starts (which memory-map it). Each child's peak RSS comes from wait4. Printed as
JSON: per count, the build (first start) and the median later start (seconds, peak MiB); then the peak's growth per
document between the two smallest counts and the time ratio of their later starts (the issue's targets: <= 4 bytes
per document, <= 2x for 4x the documents). Sizes alternate within each repeat; a shared host makes times noisy.

(b) --prepared-gb G: a prepared directory (format 2, byte tokens, 1 GB shards of 2,000-token documents, meta.json
with every hash) of G GB. Printed: one pass over its .bin files (sha256, what a start that verifies whole files
costs), the first start (which builds the index cache) and a later one with --code's inspect_data.py, and, in
this process, each of the first --steps steps' read time on a fresh open (each new 64 MiB chunk is hashed when
first read: what `data_wait_s` pays at the start of a run). The files sit in the page cache after being written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
_CHUNK = 1 << 22  # documents written at a time: the writer's memory stays ~100 MB at any count


def write_prefix(prefix: Path, num_documents: int, seed: int = 0, lengths: np.ndarray | None = None) -> Path:
    """PREFIX.bin + PREFIX.idx of `num_documents` random byte-token documents (of 2..13 tokens, or `lengths`),
    written in pieces."""
    from parallel_attention.training.data.indexed_dataset import DTYPE_CODES, HEADER, VERSION
    if Path(f"{prefix}.idx").is_file():
        return prefix
    rng, code = np.random.default_rng(seed), next(c for c, t in DTYPE_CODES.items() if np.dtype(t) == np.uint16)
    given, lengths = lengths, np.empty(num_documents, dtype="<i4")
    with open(f"{prefix}.bin", "wb") as f:
        for lo in range(0, num_documents, _CHUNK):
            count = min(_CHUNK, num_documents - lo)
            part = (rng.integers(2, 14, count) if given is None else given[lo:lo + count]).astype("<i4")
            lengths[lo:lo + len(part)] = part
            f.write(rng.integers(1, 256, int(part.sum()), dtype="<u2").tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(HEADER + struct.pack("<QBQQ", VERSION, code, num_documents, num_documents + 1))
        f.write(lengths.tobytes())
        carry = 0
        for lo in range(0, num_documents, _CHUNK):
            part = lengths[lo:lo + _CHUNK].astype("<i8") * 2
            pointers = carry + np.concatenate([[0], np.cumsum(part[:-1])])
            carry = int(pointers[-1] + part[-1])
            f.write(pointers.astype("<i8").tobytes())
        for lo in range(0, num_documents + 1, _CHUNK):
            f.write(np.arange(lo, min(lo + _CHUNK, num_documents + 1), dtype="<i8").tobytes())
    return prefix


def prepared_directory(path: Path, gigabytes: float) -> tuple[Path, float]:
    """A prepared directory of `gigabytes` of byte tokens and the seconds one sha256 pass over its .bin took."""
    from parallel_attention.training.data.chunk_hashes import CHUNK_BYTES, file_and_chunk_sha256
    from parallel_attention.checkpointing.tensor_io import file_digest
    shards, tokens_left, began = [], int(gigabytes * 2**30 / 2), None
    path.mkdir(parents=True, exist_ok=True)
    for k in range(-(-tokens_left // 2**29)):
        documents = min(tokens_left, 2**29) // 2000
        lengths = np.full(documents, 2000)
        prefix = write_prefix(path / f"shard_{k:05d}", documents, seed=k, lengths=lengths)
        shards.append({"prefix": prefix.name, "num_documents": documents, "num_tokens": documents * 2000})
        tokens_left -= documents * 2000
    began = time.perf_counter()
    for shard in shards:
        shard["bin_sha256"], shard["bin_chunk_sha256"] = file_and_chunk_sha256(path / f"{shard['prefix']}.bin")
        shard.update(idx_sha256=file_digest(path / f"{shard['prefix']}.idx")["sha256"], chunk_bytes=CHUNK_BYTES)
    one_pass = time.perf_counter() - began
    meta = {"format": "indexed", "format_version": 2, "tokenizer": "byte", "tokenizer_sha256": None, "dtype": "uint16",
            "vocab_size": 256, "eot_token": 0, "num_tokens": sum(s["num_tokens"] for s in shards), "shards": shards}
    (path / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    return path, one_pass


def first_steps(data_dir: Path, steps: int) -> list[float]:
    """Seconds to read each of the first `steps` steps' batches (8 windows of 1025 tokens) on a fresh open."""
    from parallel_attention.training.data.read.batches import GlobalBatchSampler
    from parallel_attention.training.data.read.token_source import open_source
    source = open_source(str(data_dir), 0.02, (256, "byte"))
    sampler = GlobalBatchSampler([source], [1.0], 1024, 8, seed=0)
    times = []
    for step in range(steps):
        began = time.perf_counter()
        sampler.local_micro_batches(step, 0, 1, 8)
        times.append(time.perf_counter() - began)
    return times


# the child's own peak: /proc's VmHWM belongs to its address space (wait4's ru_maxrss would also count the parent's
# memory at the fork, which exec keeps in the child's record); run in `code`, whose package -c then imports first
PEAK = """
import atexit, runpy, sys
def peak():
    with open("/proc/self/status") as f:
        line = next(l for l in f if l.startswith("VmHWM:"))
    print("peak_rss_kib", line.split()[1], file=sys.stderr)
atexit.register(peak)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def start(code: Path, prefix: Path, run_dir: Path, cache: Path) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of one inspect_data.py process on `prefix` with the index cache in `cache`."""
    command = [sys.executable, "-c", PEAK, str(code / "scripts" / "inspect_data.py"), "--config",
               str(ROOT / "configs" / "gpt_tiny.yaml"), f"--data.blend=[{{path: '{prefix}', weight: 1.0}}]",
               "--data.seq_len=32", "--model.max_seq_len=32", "--training.global_batch_size=8",
               "--training.micro_batch_size=8", f"--logging.run_dir={run_dir}", "--steps", "0:1"]
    data = code / "parallel_attention" / "training" / "data"
    if (data / "index_cache.py").is_file() or (data / "read" / "index_cache.py").is_file():
        command.append(f"--data.index_cache={cache}")
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    began = time.perf_counter()
    child = subprocess.run(command, env=env, cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - began
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {child.stderr[-2000:]}")
    return seconds, int(child.stderr.split("peak_rss_kib")[-1].split()[0]) / 1024


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=float, nargs="+", default=[2e6, 8e6], help="document counts (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="later starts per count (default: %(default)s)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/index_bench"), help="where prefixes and caches go")
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout whose inspect_data.py runs")
    parser.add_argument("--prepared-gb", type=float, help="(b): a prepared directory of this many GB instead")
    parser.add_argument("--steps", type=int, default=4, help="(b): the first steps whose reads are timed")
    args = parser.parse_args(argv)
    if args.prepared_gb:
        return prepared_figures(args)
    counts = [int(n) for n in args.docs]
    args.dir.mkdir(parents=True, exist_ok=True)
    prefixes = {n: write_prefix(args.dir / f"synthetic_{n}_text_document", n) for n in counts}
    caches = {n: args.dir / f"cache_{n}_{os.getpid()}" for n in counts}
    results = {n: {"documents": n} for n in counts}
    for n in counts:
        results[n]["build_s"], results[n]["build_peak_mib"] = start(args.code, prefixes[n], args.dir / "run", caches[n])
    later = {n: [] for n in counts}
    for _ in range(args.repeats):
        for n in counts:
            later[n].append(start(args.code, prefixes[n], args.dir / "run", caches[n]))
    for n in counts:
        results[n]["start_s"] = statistics.median(s for s, _ in later[n])
        results[n]["start_peak_mib"] = statistics.median(m for _, m in later[n])
        shutil.rmtree(caches[n], ignore_errors=True)
    small, large = results[counts[0]], results[counts[-1]]
    growth = (large["start_peak_mib"] - small["start_peak_mib"]) * 2**20 / (counts[-1] - counts[0]) \
        if len(counts) > 1 else None
    print(json.dumps({"code": str(args.code), "sizes": list(results.values()), "bytes_per_document": growth,
                      "start_ratio": large["start_s"] / small["start_s"]}, indent=1))
    return 0


def prepared_figures(args) -> int:
    data_dir, one_pass = prepared_directory(args.dir / f"prepared_{args.prepared_gb:g}gb", args.prepared_gb)
    shutil.rmtree(data_dir / ".index_cache", ignore_errors=True)
    (data_dir / ".sha256-cache.json").unlink(missing_ok=True)
    first = start(args.code, data_dir, args.dir / "run", args.dir / "cache_prepared")
    later = start(args.code, data_dir, args.dir / "run", args.dir / "cache_prepared")
    shutil.rmtree(data_dir / ".index_cache", ignore_errors=True)
    steps = first_steps(data_dir, args.steps) if args.code == ROOT else None
    print(json.dumps({"code": str(args.code), "gigabytes": args.prepared_gb, "one_pass_s": one_pass,
                      "first_start_s": first[0], "later_start_s": later[0], "first_steps_read_s": steps}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
