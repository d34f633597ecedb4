"""gpu_check.sh's FP8 step: torch._scaled_mm against the CPU's emulation, and what FP8 buys on this GPU.

    python benchmarks/_gpu_check_fp8.py [--iters 10] [--warmup 3]     (prints one JSON line; exit 1 if a check fails)

agreement  a ColumnParallelLinear's output, input gradient and weight gradient under bf16 autocast, tensorwise and
           rowwise (p = 1), through `_scaled_mm` and through the emulation (the same FP8 operands and scales,
           multiplied in float32 on the same GPU): within 2 bf16 ulps of the largest reference value. Both multiply
           the same exact FP8 products; only the order of the float32 sums and the final rounding to bf16 differ.
timing     forward + backward of a linear of 4096 tokens, 4096 -> 14336 features (Llama 8B's MLP), float32
           weights under bf16 autocast as training runs it, in bf16, tensorwise and rowwise: ms, TFLOP/s
           (6 M N K per step) and the speed-up over bf16. The quantization and amax kernels are counted.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from parallel_attention.tensor_parallel.layers import ColumnParallelLinear
from parallel_attention.tensor_parallel.linear_precision import fp8_linears

RECIPES = ("tensorwise", "rowwise")
ULPS = 2
CHECK_SHAPE, TIMED_SHAPE = (512, 1024, 768), (4096, 4096, 14336)  # tokens, in, out (multiples of 16)


def _step(layer, x, grad):
    """One forward + backward under bf16 autocast: (Y, dX, dW)."""
    x = x.detach().requires_grad_()
    layer.weight.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(grad)
    return y.detach(), x.grad, layer.weight.grad


def agreement(device) -> dict:
    tokens, n_in, n_out = CHECK_SHAPE
    torch.manual_seed(0)
    layer = ColumnParallelLinear(n_in, n_out, bias=False, device=device)
    x = torch.randn(tokens, 1, n_in, device=device)
    grad = torch.randn(tokens, 1, n_out, device=device, dtype=torch.bfloat16)
    results = {}
    for recipe in RECIPES:
        with fp8_linears(recipe, device):
            got = _step(layer, x, grad)
        with fp8_linears(recipe, "cpu"):  # the emulation, on the GPU's tensors
            want = _step(layer, x, grad)
        for name, a, b in zip(("out", "dx", "dw"), got, want):
            ulps = (a.float() - b.float()).abs().max().item() / (
                torch.finfo(torch.bfloat16).eps * b.float().abs().max().item())
            results[f"{recipe}_{name}"] = {"ulps": round(ulps, 3), "ok": ulps <= ULPS}
    return results


def timing(device, iters: int, warmup: int) -> dict:
    tokens, n_in, n_out = TIMED_SHAPE
    layer = ColumnParallelLinear(n_in, n_out, bias=False, device=device)
    x = torch.randn(tokens, 1, n_in, device=device)
    grad = torch.randn(tokens, 1, n_out, device=device, dtype=torch.bfloat16)
    flops = 6 * tokens * n_in * n_out
    results = {}
    for recipe in ("none",) + RECIPES:
        with fp8_linears(recipe, device):
            for _ in range(warmup):
                _step(layer, x, grad)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                _step(layer, x, grad)
            end.record()
            torch.cuda.synchronize()
        ms = start.elapsed_time(end) / iters
        results["bf16" if recipe == "none" else recipe] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
    for recipe in RECIPES:
        results[recipe]["speedup_over_bf16"] = round(results["bf16"]["ms"] / results[recipe]["ms"], 3)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        report["agreement"] = agreement(device)
        report["timing"] = timing(device, args.iters, args.warmup)
    except KeyboardInterrupt:  # gpu_check.sh's limit (SIGINT): report what finished
        report["interrupted"] = True
    report["ok"] = "interrupted" not in report and all(c["ok"] for c in report["agreement"].values())
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
