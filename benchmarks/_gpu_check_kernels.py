"""gpu_check.sh's kernel step: the CUDA kernels the CPU suite cannot run, against references, in one process.

    python benchmarks/_gpu_check_kernels.py            (prints one JSON line; exit 1 if a check fails)

ring      the ring's pair kernel on CUDA (FlashBlocks over aten._scaled_dot_product_flash_attention) in bf16 and fp16,
          forward and backward, against MathBlocks in float32 on the same rounded inputs: a causal diagonal, a full
          pair, GQA (32 / 8 heads) and a pair split by documents (odd lengths, single tokens). A world of one GPU
          cannot run a ring of ranks, so the pair kernels are called directly, as the ring calls them.
varlen    packed documents in one varlen_attn call (SdpaAttention's CUDA document kernel) against one SDPA call
          per document, forward and backward through autograd, bf16, GQA, odd and single-token documents.
Tolerance: 4 ulps of the half dtype at the largest reference value (4 eps max |ref|). The CPU tests allow one at
m 24; at m 512 a gradient sums 512 products of probabilities the kernel rounded to half (measured through the CPU
operator at these sizes: up to 2 ulps). A wrong scale, mask or causal alignment is off by hundreds.
"""

from __future__ import annotations

import json
import math
import sys

import torch

from parallel_attention.transformer.context_parallel.ring_attention import BlockMasks
from parallel_attention.transformer.kernels.ring_blocks import CUDA_FLASH_BLOCKS, MATH_BLOCKS, Pair
from parallel_attention.transformer.kernels.choice import choose_document_kernel
from parallel_attention.transformer.kernels.document_kernels import PER_DOCUMENT_SDPA
from parallel_attention.transformer.documents import DocumentLayout

B, NH, NKV, M, D = 2, 32, 8, 512, 128
ULPS = 4
DOCUMENTS = [[0] * 100 + [1] + [2] * 333 + [3] * 589 + [4], [5] * 1024]  # 2 M tokens a row


def _error(got, want, dtype) -> dict:
    """The largest error, in ulps of `dtype` at the largest reference value (<= ULPS passes)."""
    ulps = (got.float() - want).abs().max().item() / (torch.finfo(dtype).eps * want.abs().max().item())
    return {"ulps": round(ulps, 3), "ok": ulps <= ULPS}


def _pairs(device) -> dict:
    tril = torch.ones(M, M, dtype=torch.bool, device=device).tril()
    masks = BlockMasks(M, True, DocumentLayout.from_ids(torch.tensor(DOCUMENTS, device=device)), device)
    _, mask, pieces = masks.pair(1, 1)
    return {"diagonal": Pair(0, 0, tril, (0, 0), True), "full": Pair(0, 0, None, (1, 0), False),
            "documents": Pair(0, 0, mask, (1, 1), False, pieces)}


def ring_checks(device) -> dict:
    g, scale, results = torch.Generator(device=device).manual_seed(0), 1 / math.sqrt(D), {}
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(B, NH, M, D, generator=g, device=device).to(dtype)
        k, v = (torch.randn(B, NKV, M, D, generator=g, device=device).to(dtype) for _ in "kv")
        grad_out = torch.randn(B, NH, M, D, generator=g, device=device).to(dtype)
        for name, pair in _pairs(device).items():
            out, lse = CUDA_FLASH_BLOCKS.forward(q, k, v, pair, scale, None)
            want, want_lse = MATH_BLOCKS.forward(q.float(), k.float(), v.float(), pair, scale, lambda t: t)
            delta = (grad_out.float() * out.float()).sum(-1)
            grads = CUDA_FLASH_BLOCKS.backward(q, k, v, pair, scale, None, grad_out, out, lse, delta)
            wants = MATH_BLOCKS.backward(q.float(), k.float(), v.float(), pair, scale, lambda t: t,
                                         grad_out.float(), out.float(), lse, delta)
            checks = {"out": _error(out, want, dtype), "lse_abs": (lse - want_lse).abs().max().item(),
                      **{f"d{t}": _error(got, ref, dtype) for t, got, ref in zip("qkv", grads, wants)}}
            checks["ok"] = all(c["ok"] for c in checks.values() if isinstance(c, dict)) and checks["lse_abs"] < 1e-3
            results[f"{str(dtype).removeprefix('torch.')}_{name}"] = checks
    return results


def varlen_checks(device) -> dict:
    kernel, reason = choose_document_kernel(device, dropout=False)
    layout = DocumentLayout.from_ids(torch.tensor(DOCUMENTS, device=device))
    g, dtype, s = torch.Generator(device=device).manual_seed(1), torch.bfloat16, 2 * M
    inputs = [torch.randn(B, heads, s, D, generator=g, device=device).to(dtype) for heads in (NH, NKV, NKV)]
    grad_out = torch.randn(B, NH, s, D, generator=g, device=device).to(dtype)
    results = {"kernel": kernel.name, "reason": reason}
    runs = []
    for attend, run_dtype in ((kernel, dtype), (PER_DOCUMENT_SDPA, torch.float32)):
        leaves = [t.to(run_dtype).detach().requires_grad_() for t in inputs]
        out = attend(*leaves, layout, True, 0.0)
        out.backward(grad_out.to(run_dtype))
        runs.append([out.detach()] + [t.grad for t in leaves])
    for name, got, want in zip(("out", "dq", "dk", "dv"), *runs):
        results[name] = _error(got, want, dtype)
    results["ok"] = all(results[n]["ok"] for n in ("out", "dq", "dk", "dv")) and "varlen" in kernel.name
    return results


def main() -> int:
    device = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name()}
    try:
        report["ring"] = ring_checks(device)
        report["varlen"] = varlen_checks(device)
    except KeyboardInterrupt:  # gpu_check.sh's limit (SIGINT): report what finished
        report["interrupted"] = True
    report["ok"] = ("interrupted" not in report and all(c["ok"] for c in report["ring"].values())
                    and report["varlen"]["ok"])
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
