"""gpu_check.sh's attention step: the attention block's forward + backward TFLOP/s against the device's dense bf16
peak, at p = 1 (one GPU): h 4096, 32 query heads / 8 k/v heads (d 128), s 4096, b 2, causal, rotary, bf16.

    python benchmarks/_gpu_check_attention.py [--iters 10] [--warmup 3]     (prints one JSON line)

FLOPs of one step (model FLOPs, as flops.py counts a training step: backward = 2 x forward, no recomputation):
    projections   2 s b h (nh + 2 nkv) d   (QKV)   +   2 s b (nh d) h   (output)
    attention     2 x 2 b nh s^2 d / 2     (q k^T and p v, half of the square under the causal mask)
    step          3 x (projections + attention)
Target: >= 50 % of the peak (issue 31), reported whether met or not. The peak is the data sheet's dense bf16 figure
for a known GPU (training/flops.py's table), else a GEMM rate measured now.
"""

from __future__ import annotations

import argparse
import json

import torch

import parallel_attention as pa
from parallel_attention.training.flops import gpu_table_peak, measured_gemm_tflops

S, B, H, NH, NKV = 4096, 2, 4096, 32, 8
TARGET = 0.5


def step_flops() -> float:
    d = H // NH
    projections = 2 * S * B * H * (NH + 2 * NKV) * d + 2 * S * B * NH * d * H
    attention = 2 * 2 * B * NH * S * S * d / 2
    return 3.0 * (projections + attention)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    config = pa.AttentionConfig(hidden_size=H, num_heads=NH, num_kv_heads=NKV, rotary=True, qkv_bias=False,
                                out_bias=False, params_dtype=torch.bfloat16)
    block = pa.ParallelSelfAttention(config, device=device)
    x = torch.randn(S, B, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(args.warmup):
        block(x).backward(grad)
    torch.cuda.synchronize()
    start.record()
    for _ in range(args.iters):
        block(x).backward(grad)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / args.iters
    tflops = step_flops() / (ms / 1e3) / 1e12
    name = torch.cuda.get_device_name()
    peak = gpu_table_peak(name) or measured_gemm_tflops(device)
    print(json.dumps({"device": name, "case": {"s": S, "b": B, "h": H, "nh": NH, "nkv": NKV, "dtype": "bfloat16"},
                      "step_ms": round(ms, 3), "tflops": round(tflops, 1), "peak_tflops": peak,
                      "fraction_of_peak": round(tflops / peak, 3), "target": TARGET,
                      "target_met": tflops / peak >= TARGET, "kernels": pa.active_paths()}))


if __name__ == "__main__":
    main()
