"""gpu_check.sh's probe step: what the CPU suite can only show by reading torch's sources, checked on the device.

    python benchmarks/_gpu_check_probe.py [--device cuda]     (prints one JSON line; exit 1 if a check fails)

autocast      under bf16 autocast with float32 parameters, the dtypes of q, k and v as they reach the core attention
              (after the per-head q/k norm and rotary): all bfloat16, so the fused kernels take them
varlen        grouped k/v (32 / 8 heads) given to the installed varlen_attn as they are (document_kernels) against
              the same call with k/v repeated to the query heads, forward and backward through autograd, bf16: the
              output within ULPS, the gradients within ULPS (grouped: the kernel sums each group's dk, dv itself)
dropout_hash  layout-invariant dropout's keep masks (attention probabilities [2, 4, 512, 512] of heads 4.. of 16,
              hidden [512, 2, 1024]) hashed on the device equal the CPU's bit for bit, in blocks and in one pass
On a device without CUDA (--device cpu, as the tests run it) varlen is skipped and says why.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from parallel_attention.tensor_parallel import dropout_hash
from parallel_attention.transformer.attention import ParallelSelfAttention
from parallel_attention.transformer.attention_config import AttentionConfig
from parallel_attention.transformer.documents import DocumentLayout
from parallel_attention.transformer.kernels.document_kernels import varlen_choice
from parallel_attention.transformer.kernels.kv_groups import repeat_kv

NH, NKV, D, S = 32, 8, 128, 1024
ULPS = 4  # as the kernels step: a wrong grouping is off by far more
DOCUMENTS = [[0] * 100 + [1] + [2] * 333 + [3] * 589 + [4], [5] * 1024]


def autocast_dtypes(device: torch.device) -> dict:
    config = AttentionConfig(hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64, rotary=True, qk_norm=True,
                             attention_kernel="sdpa")
    attention, seen = ParallelSelfAttention(config, device=device), {}
    attention.core_attention.register_forward_pre_hook(
        lambda module, args: seen.update(zip("qkv", (str(t.dtype).removeprefix("torch.") for t in args[:3]))))
    x = torch.randn(256, 2, 512, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        attention(x).float().sum().backward()
    return {**seen, "ok": set(seen.values()) == {"bfloat16"} and len(seen) == 3}


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in ulps of got's dtype at the largest value of `want`."""
    scale = torch.finfo(got.dtype).eps * want.float().abs().max().item()
    return (got.float() - want.float()).abs().max().item() / scale


def varlen_grouped(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"skipped": "varlen_attn runs on CUDA only"}
    kernel, reason = varlen_choice()
    if kernel is None:
        return {"ok": False, "reason": reason}
    layout = DocumentLayout.from_ids(torch.tensor(DOCUMENTS, device=device))
    g = torch.Generator(device=device).manual_seed(2)
    inputs = [torch.randn(2, heads, S, D, generator=g, device=device).to(torch.bfloat16) for heads in (NH, NKV, NKV)]
    grad_out = torch.randn(2, NH, S, D, generator=g, device=device).to(torch.bfloat16)
    runs = []
    for expand in (lambda t: t, lambda t: repeat_kv(t, NH)):
        q, k, v = (t.detach().requires_grad_() for t in inputs)
        out = kernel(q, expand(k), expand(v), layout, True, 0.0)
        out.backward(grad_out)
        runs.append([out.detach(), q.grad, k.grad, v.grad])
    found = {"reason": reason, "out_identical": torch.equal(runs[0][0], runs[1][0])}
    found.update({name: round(_ulps(got, want), 3) for name, got, want in zip(("out", "dq", "dk", "dv"), *runs)})
    found["ok"] = all(found[name] <= ULPS for name in ("out", "dq", "dk", "dv"))
    return found


def _masks(device) -> list[torch.Tensor]:
    key = dropout_hash.stream_key(1234, 56, 7, 1)
    attention = [(dropout_hash.as_key(3), 2, 16 * 512 * 512), (4, 4, 512 * 512), (0, 512, 512), (0, 512, 1)]
    hidden = [(0, 512, 2 * 1024), (5, 2, 512 * 1024), (0, 1024, 1)]
    return [dropout_hash.keep_mask(0.1, key, axes, device).cpu() for axes in (attention, hidden)]


def dropout_hash_equal(device: torch.device) -> dict:
    cpu, blocks = _masks("cpu"), _masks(device)
    saved, dropout_hash.BLOCK_ELEMENTS = dropout_hash.BLOCK_ELEMENTS, 1 << 62
    try:
        one_pass = _masks(device)
    finally:
        dropout_hash.BLOCK_ELEMENTS = saved
    found = {"blocks_equal_cpu": all(map(torch.equal, blocks, cpu)),
             "one_pass_equal_cpu": all(map(torch.equal, one_pass, cpu)),
             "keep_rate": round(cpu[0].float().mean().item(), 4)}
    found["ok"] = found["blocks_equal_cpu"] and found["one_pass_equal_cpu"]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    device = torch.device(parser.parse_args().device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type}
    try:
        report.update(autocast=autocast_dtypes(device), varlen=varlen_grouped(device),
                      dropout_hash=dropout_hash_equal(device))
    except KeyboardInterrupt:  # gpu_check.sh's limit (SIGINT): report what finished
        report["interrupted"] = True
    checks = [report[name] for name in ("autocast", "varlen", "dropout_hash") if name in report]
    report["ok"] = "interrupted" not in report and all(c.get("ok", "skipped" in c) for c in checks)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
