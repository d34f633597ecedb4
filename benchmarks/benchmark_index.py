"""Opening a Megatron-LM prefix, side by side: peak memory and start-up against the number of documents.

    python benchmarks/benchmark_index.py --docs 2e6 8e6 --repeats 3 --dir /tmp/index_bench
    python benchmarks/benchmark_index.py --docs 2e6 8e6 --code /path/to/another/checkout   # the same on other code

For each --docs count a synthetic prefix is written once (documents of 2..13 byte tokens, uint16, so the corpus is
small and the per-document index dominates). Then scripts/inspect_data.py, the trainer's own data path, says what
step 0 read, in a fresh process each time: the first start (which builds the index cache under a fresh
data.index_cache) and --repeats later starts (which memory-map it). Each child's peak RSS comes from wait4. Printed as
JSON: per count, the build (first start) and the median later start (seconds, peak MiB); then the peak's growth per
document between the two smallest counts and the time ratio of their later starts (the issue's targets: <= 4 bytes
per document, <= 2x for 4x the documents). Sizes alternate within each repeat; a shared host makes times noisy.
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


def write_prefix(prefix: Path, num_documents: int, seed: int = 0) -> Path:
    """PREFIX.bin + PREFIX.idx of `num_documents` random byte-token documents, written in pieces."""
    from parallel_attention.training.data.indexed_dataset import DTYPE_CODES, HEADER, VERSION
    if Path(f"{prefix}.idx").is_file():
        return prefix
    rng, code = np.random.default_rng(seed), next(c for c, t in DTYPE_CODES.items() if np.dtype(t) == np.uint16)
    lengths = np.empty(num_documents, dtype="<i4")
    with open(f"{prefix}.bin", "wb") as f:
        for lo in range(0, num_documents, _CHUNK):
            part = rng.integers(2, 14, min(_CHUNK, num_documents - lo)).astype("<i4")
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


def start(code: Path, prefix: Path, run_dir: Path, cache: Path) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of one inspect_data.py process on `prefix` with the index cache in `cache`."""
    command = [sys.executable, str(code / "scripts" / "inspect_data.py"), "--config",
               str(ROOT / "configs" / "gpt_tiny.yaml"), f"--data.blend=[{{path: '{prefix}', weight: 1.0}}]",
               "--data.seq_len=32", "--model.max_seq_len=32", "--training.global_batch_size=8",
               "--training.micro_batch_size=8", f"--logging.run_dir={run_dir}", "--steps", "0:1"]
    if (code / "parallel_attention" / "training" / "data" / "index_cache.py").is_file():
        command.append(f"--data.index_cache={cache}")
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    began = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - began
    if status != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {child.stderr.read().decode()[-2000:]}")
    return seconds, usage.ru_maxrss / 1024  # ru_maxrss is in KiB on Linux


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=float, nargs="+", default=[2e6, 8e6], help="document counts (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="later starts per count (default: %(default)s)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/index_bench"), help="where prefixes and caches go")
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout whose inspect_data.py runs")
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
