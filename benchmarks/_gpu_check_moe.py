"""gpu_check.sh's MoE step: one MoE layer on one GPU, its experts on torch._grouped_mm in bf16, against the CPU's float32
layer on the same weights, forward and backward; then the layer's tokens/s at Qwen3-30B-A3B's shape.

    python benchmarks/_gpu_check_moe.py [--device cuda] [--iters 10] [--warmup 3]    (prints one JSON line;
                                                                                    exit 1 if the check fails)

agreement  a 16-expert top-4 SwiGLU layer (h 256, expert FFN 128, 512 tokens), float32 weights, run as training
           runs it: bf16 autocast, the input in bf16, so the experts multiply in bf16 (float32 accumulation) while
           the router stays float32. The reference: the same layer and input (the bf16 values) on the CPU in
           float32. Output, input gradient and the router's and experts' gradients within 2e-2 of the largest
           reference value (a few bf16 roundings of each product chain; the project's tolerance for half types).
           Tokens whose choice of experts differs (a near tie that float32's summation order flips; at most
           0.2 % of them) are left out of the output and input-gradient comparison; with any, the weight
           gradients (sums over every token) are reported, not compared.
timing     forward + backward of one layer at Qwen3-30B-A3B's shape (h 2048, 128 experts, top-8, expert FFN 768)
           on --tokens tokens, bf16 autocast: ms, tokens/s and the experts' TFLOP/s (6 T k 3 h f a step).
--device cpu runs the same code on the CPU (the test suite's run of this step: --shape check, a small --tokens).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

from parallel_attention.transformer.model_config import ModelConfig
from parallel_attention.transformer.moe import MoELayer, moe_step

TOLERANCE, MAX_FLIPPED = 2e-2, 0.002
CHECK, CHECK_TOKENS = dict(hidden_size=256, num_experts=16, moe_top_k=4, moe_ffn_hidden_size=128), 512
TIMED = dict(hidden_size=2048, num_experts=128, moe_top_k=8, moe_ffn_hidden_size=768)


def moe_layer(shape: dict, device) -> MoELayer:
    cfg = ModelConfig(vocab_size=256, num_layers=1, num_heads=4, activation="swiglu", norm="rmsnorm",
                      position_embedding="rotary", moe_aux_loss_coeff=0.01, max_seq_len=64,
                      **shape)
    torch.manual_seed(0)
    return MoELayer(cfg, device=device)


def _run(layer: MoELayer, x: torch.Tensor, grad: torch.Tensor, autocast: bool) -> list[torch.Tensor]:
    """Output, input, router and experts' gradients of one forward + backward (bf16 autocast or none)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast), moe_step(1.0):
        y = layer(x)
    y.backward(grad)
    weights = (layer.gate.weight, layer.experts.gate_up_proj, layer.experts.down_proj)
    return [t.detach().float().cpu() for t in (y, x.grad, *(w.grad for w in weights))]


@torch.no_grad()
def _chosen(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The experts each token chose [T, k] (the router runs in float32 under autocast too)."""
    return layer.gate(x.reshape(-1, x.shape[-1])).expert_ids.cpu()


def agreement(device) -> dict:
    reference = moe_layer(CHECK, "cpu")
    layer = copy.deepcopy(reference).to(device)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(CHECK_TOKENS, 1, CHECK["hidden_size"], generator=generator).bfloat16()
    grad = torch.randn(x.shape, generator=generator).bfloat16()
    want, got = _run(reference, x.float(), grad.float(), False), _run(layer, x.to(device), grad.to(device), True)
    same = (_chosen(reference, x.float()) == _chosen(layer, x.to(device))).all(-1)
    results = {"tokens_flipped": int((~same).sum()), "tolerance": TOLERANCE}
    for i, name in enumerate(("out", "dx", "d_router", "d_gate_up_proj", "d_down_proj")):
        a, b = got[i], want[i]
        if i < 2:  # per token: the tokens routed alike
            a, b = a[same], b[same]
        elif not same.all():
            results[name] = {"compared": False}
            continue
        error = ((a - b).abs().max() / b.abs().max()).item()
        results[name] = {"error": round(error, 5), "ok": error <= TOLERANCE}
    results["ok"] = all(r.get("ok", True) for r in results.values() if isinstance(r, dict)) and bool(
        (~same).float().mean() <= MAX_FLIPPED)
    return results


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timing(device, shape: dict, tokens: int, iters: int, warmup: int) -> dict:
    layer = moe_layer(shape, device)
    x = torch.randn(tokens, 1, shape["hidden_size"], device=device, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    for _ in range(warmup):
        _run(layer, x, grad, autocast=True)
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        _run(layer, x, grad, autocast=True)
    _synchronize(device)
    seconds = (time.perf_counter() - start) / iters
    flops = 6 * tokens * shape["moe_top_k"] * 3 * shape["hidden_size"] * shape["moe_ffn_hidden_size"]
    return {"shape": {**shape, "tokens": tokens}, "ms": round(seconds * 1e3, 3),
            "tokens_per_s": round(tokens / seconds), "experts_tflops": round(flops / seconds / 1e12, 2),
            "experts": layer.active_paths()["experts"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--shape", choices=("qwen3_30b_a3b", "check"), default="qwen3_30b_a3b",
                        help="the timed layer's shape: Qwen3-30B-A3B's, or the small one of the agreement check")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    try:
        report["agreement"] = agreement(device)
        shape = TIMED if args.shape == "qwen3_30b_a3b" else CHECK
        report["timing"] = timing(device, shape, args.tokens, args.iters, args.warmup)
    except KeyboardInterrupt:  # gpu_check.sh's limit (SIGINT): report what finished
        report["interrupted"] = True
    report["ok"] = "interrupted" not in report and report["agreement"]["ok"]
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
