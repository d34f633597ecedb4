"""Time the three GEMMs of a linear on this CPU, torch's own (MKL) against oneDNN's inner product.

    OMP_NUM_THREADS=1 python scripts/benchmark_gemm.py [--tokens 1024] [--shape K,N ...] [--reps 15] [--out OUT.json]

For each weight shape [N, K] and M tokens, one thread, float32, forms alternating within each repetition:
    forward    Y = X W^T    F.linear (MKL)            oneDNN's operator, as tensor_parallel/gemm.py's `linear` calls it
    dX         dY W         dY.matmul(W) (MKL)        oneDNN's operator with W^T, as `input_grad` calls it
    dW         dY^T X       dY.t().mm(X) (MKL)        X.t().mm(dY).t() (MKL, the other order)
The package takes MKL's first forms by default, and oneDNN for the forward and dX with
PARALLEL_ATTENTION_ONEDNN_LINEAR=1 (`gemm.onednn_linear_active()`); the oneDNN forms are timed wherever the
operator is available. Default shapes: the Llama-style benchmark model of docs/benchmarks.md at p = 1 (h 512, fused
QKV 768, gate+up 2816, down 1408, vocabulary 8192).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from parallel_attention.tensor_parallel import gemm

DEFAULT_SHAPES = ("512,768", "512,512", "512,2816", "1408,512", "512,8192")


def forms(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> dict:
    """name -> the GEMM, on the same operands."""
    out = {"forward_mkl": lambda: F.linear(x, w), "dX_mkl": lambda: g.matmul(w), "dW_mkl": lambda: g.t().mm(x),
           "dW_mkl_other_order": lambda: x.t().mm(g).t()}
    if gemm.onednn_available():
        out.update({"forward_onednn": lambda: gemm.onednn_inner_product(x, w),
                    "dX_onednn": lambda: gemm.onednn_inner_product(g, w.t())})
    return out


def time_shape(m: int, k: int, n: int, reps: int) -> dict[str, float]:
    """Median ms of each form, alternating within each repetition (the first round untimed)."""
    x, w, g = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
    fns = forms(x, w, g)
    times = {name: [] for name in fns}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if rep:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="M, rows of X (default: %(default)s)")
    parser.add_argument("--shape", action="append", help="K,N of a weight [N, K] (repeatable)")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions (default: %(default)s)")
    parser.add_argument("--out", help="write the figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results, totals = [], {}
    for text in args.shape or DEFAULT_SHAPES:
        k, n = (int(v) for v in text.split(","))
        ms = time_shape(args.tokens, k, n, args.reps)
        results.append({"m": args.tokens, "k": k, "n": n, "ms": ms,
                        "gflops": {name: 2 * args.tokens * k * n / t / 1e6 for name, t in ms.items()}})
        print(f"M {args.tokens} K {k} N {n}: " + "  ".join(f"{name} {t:.1f}" for name, t in ms.items()), flush=True)
        for name, t in ms.items():
            totals[name] = totals.get(name, 0.0) + t
    print("total ms: " + "  ".join(f"{name} {t:.1f}" for name, t in totals.items()))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"torch": torch.__version__, "onednn_active": gemm.onednn_linear_active(),
                       "shapes": results, "total_ms": totals}, f, indent=1)


if __name__ == "__main__":
    main()
