"""gpu_check.sh --gpus N's ring step: a cp = N ring whose k/v blocks are large enough that NCCL cannot buffer a
send (64 MiB each: an unbatched send/receive pair would hang here), against one SDPA call over the whole sequence.

    torchrun --nproc-per-node N benchmarks/_gpu_check_ring.py [--kv-mib 64]   (rank 0 prints one JSON line)

Every rank draws the same full q, k, v [1, heads, s, d] and output gradient (one seed), runs the ring
(RingCoreAttention, causal) on its zigzag part and the reference on the whole sequence, and compares its part of the
output and of dq, dk, dv. On CUDA: NCCL, bf16, 32 / 8 heads of 128 (the ring's flash pair kernels; the reference is
flash SDPA), error in ulps of bf16 at the largest reference value, <= ULPS passes. Both sides round the same bf16
inputs; each is within a few ulps of exact, and the gradients add the rounding of long sums. Without CUDA the same
program runs on gloo in float32 (tests/test_gpu_check.py, small --kv-mib): relative error <= 1e-5.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel_attention.tensor_parallel import init_distributed
from parallel_attention.tensor_parallel.parallel_state import get_context_parallel_group, shutdown_distributed
from parallel_attention.transformer.context_parallel import RingCoreAttention, split_for_context_parallel
from parallel_attention.transformer.kernels.kv_groups import repeat_kv

NH, NKV, D = 32, 8, 128
ULPS = 16


def _inputs(s: int, dtype, device) -> list[torch.Tensor]:
    """q, k, v and the output gradient over the whole sequence, the same on every rank."""
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(1, heads, s, D, generator=g, device=device).to(dtype) for heads in (NH, NKV, NKV, NH)]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error relative to the largest reference value: in ulps for half dtypes, plain for float32."""
    relative = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
    return relative / torch.finfo(want.dtype).eps if want.dtype != torch.float32 else relative


def compare(kv_mib: float, device: torch.device) -> dict:
    cp_group = get_context_parallel_group()
    cp, dtype = dist.get_world_size(cp_group), torch.bfloat16 if device.type == "cuda" else torch.float32
    m = max(2, int(kv_mib * 2**20 / (NKV * D * dtype.itemsize)) // 2 * 2)  # this rank's tokens: k is kv_mib MiB
    q, k, v, grad = _inputs(m * cp, dtype, device)
    parts = [split_for_context_parallel(t, cp_group, dim=2).detach().requires_grad_() for t in (q, k, v)]
    out = RingCoreAttention(cp_group, NH // NKV, device=device)(*parts, None, True)
    out.backward(split_for_context_parallel(grad, cp_group, dim=2))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    kv = [repeat_kv(t, NH) for t in leaves[1:]]  # flash-eligible at any torch (no enable_gqa)
    want = F.scaled_dot_product_attention(leaves[0], *kv, is_causal=True)
    want.backward(grad)
    errors = {name: _error(got, split_for_context_parallel(ref, cp_group, dim=2))
              for name, got, ref in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in parts],
                                        [want] + [t.grad for t in leaves])}
    bound = ULPS if dtype != torch.float32 else 1e-5
    worst = torch.tensor([max(errors.values())], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"cp": cp, "dtype": str(dtype).removeprefix("torch."), "tokens_per_rank": m,
            "kv_block_mib": m * NKV * D * dtype.itemsize / 2**20, "rank0_errors": errors,
            "worst_error": worst.item(), "bound": bound, "ok": worst.item() <= bound}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-mib", type=float, default=64.0, help="MiB of each rank's k block (and of its v block)")
    args = parser.parse_args(argv)
    device = init_distributed(context_parallel_size=int(os.environ.get("WORLD_SIZE", "1")))
    try:
        report = compare(args.kv_mib, device)
        if dist.get_rank() == 0:
            print(json.dumps(report), flush=True)
    finally:
        shutdown_distributed()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
