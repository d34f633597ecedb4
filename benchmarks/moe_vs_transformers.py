"""Our MoE layer at one process against transformers' own Qwen3-MoE sparse block on the same weights, forward and
backward, side by side.

    python benchmarks/moe_vs_transformers.py --rounds 5 --iters 3

The block: Qwen3-30B-A3B's routing (128 experts, top-8, top-k renormalised) at hidden 512 and expert FFN 192 (its
8:3 ratio), 2048 tokens, float32, one thread. A one-layer Qwen3MoeForCausalLM is drawn by transformers (every
weight N(0, 0.02)), saved, and imported through our converter (`hf_to_canonical`, `load_canonical_state_dict`); the
two layers then run on the same input. Its router_aux_loss_coef is 0 (transformers' block computes no auxiliary
loss; ours still computes its losses and load, at no weight, and pays for them). First the check: on 128 tokens,
the output, the input gradient and every weight gradient equal ours within 1e-5 of the largest value for each of
transformers' experts implementations that runs on this device (`eager`, `batched_mm`, `grouped_mm`); on the
full batch, for the timed one. Then the timing: --implementation (transformers' default and fastest on CPU,
`grouped_mm`: torch._grouped_mm, as ours) alternates with ours, the first rotating; each round's step is the
median of --iters after one warm-up, on the wall clock and in CPU time. A third variant, `experts_only`, runs our experts alone (the two grouped
matmuls and SwiGLU, forward and backward) on the rows already sorted by expert: the floor of any layer built on
that kernel, which transformers' is too. Prints one JSON object: the errors, each variant's median step (ms, wall
and CPU), the medians of the rounds' ratios ours / transformers (the issue's goal <= 0.8) and experts_only /
transformers, and the experts' kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from parallel_attention.hf.convert import hf_to_canonical
from parallel_attention.transformer.model import GPTModel
from parallel_attention.transformer.moe import moe_step

CHECK_TOKENS, TOLERANCE = 128, 1e-5  # float32: the two sum the same products in other orders


def build_pair(hidden: int, experts: int, top_k: int, ffn: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(our MoELayer, transformers' Qwen3MoeSparseMoeBlock) holding the same weights, through our converter."""
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden,
                            moe_intermediate_size=ffn, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, num_experts=experts, num_experts_per_tok=top_k,
                            norm_topk_prob=True, router_aux_loss_coef=0.0, max_position_embeddings=64)
    torch.manual_seed(0)
    theirs = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.02)
    with tempfile.TemporaryDirectory() as directory:
        theirs.save_pretrained(directory)
        cfg, canonical = hf_to_canonical(directory)
    ours = GPTModel(cfg)
    ours.load_canonical_state_dict(canonical)
    return ours.layers[0].mlp.train(), theirs.train()


def step(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """Forward + backward on x [T, 1, h] (transformers' block takes [1, T, h]): output, input and weight gradients."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    ours = hasattr(layer, "active_paths")
    with moe_step(1.0):
        y = layer(x) if ours else layer(x.transpose(0, 1)).transpose(0, 1)
    y.backward(grad)
    weights = [layer.gate.weight, layer.experts.gate_up_proj, layer.experts.down_proj]
    return [y.detach(), x.grad, *(w.grad for w in weights)]


class ExpertsOnly:
    """Our experts on the rows as dispatch hands them over (sorted by expert), forward and backward, no routing."""

    def __init__(self, layer: torch.nn.Module, x: torch.Tensor) -> None:
        tokens = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            expert_ids = layer.gate(tokens).expert_ids.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)
        self.experts, self.rows = layer.experts, tokens[order // layer.gate.top_k]
        self.counts = torch.bincount(expert_ids, minlength=layer.num_experts)

    def __call__(self, grad: torch.Tensor) -> None:
        self.experts.zero_grad(set_to_none=True)
        rows = self.rows.detach().requires_grad_()
        self.experts(rows, self.counts).backward(grad)


def worst_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((u - v).abs().max() / v.abs().max()).item() for u, v in zip(a, b))


def check(ours, theirs, block, x, grad, implementations) -> dict[str, float]:
    """Each implementation's worst relative error against ours (the fused block's weights are ours, renamed)."""
    errors = {}
    for name, tokens in implementations:
        theirs.set_experts_implementation(name)
        errors[name] = round(worst_error(step(ours, x[:tokens], grad[:tokens]),
                                         step(block, x[:tokens], grad[:tokens])), 9)
        if errors[name] > TOLERANCE:
            raise SystemExit(f"{name}: ours differs from transformers' by {errors[name]:.3g} (> {TOLERANCE})")
    return errors


def step_ms(run, iters: int) -> tuple[float, float]:
    """(wall, CPU) ms of one step, each the median of `iters` after a warm-up. One thread: on an idle host the two
    agree; on a shared one the CPU time leaves out the time other processes held the core."""
    wall, cpu = [], []
    for _ in range(iters + 1):  # the first: warm-up
        start, start_cpu = time.perf_counter(), time.process_time()
        run()
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return statistics.median(wall[1:]), statistics.median(cpu[1:])


def paired(times: dict, name: str, baseline: str, clock: int) -> float:
    """The median over rounds of name's step / baseline's step (clock 0: wall, 1: CPU)."""
    return round(statistics.median(a[clock] / b[clock] for a, b in zip(times[name], times[baseline])), 3)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=192)
    parser.add_argument("--implementation", default="grouped_mm")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ours, theirs = build_pair(args.hidden, args.experts, args.top_k, args.ffn)
    block = theirs.model.layers[0].mlp
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, 1, args.hidden, generator=generator)
    grad = torch.randn(args.tokens, 1, args.hidden, generator=generator)
    small = min(CHECK_TOKENS, args.tokens)
    errors = check(ours, theirs, block, x, grad, [(name, small) for name in ("eager", "batched_mm", "grouped_mm")])
    errors[f"{args.implementation}_all_tokens"] = check(ours, theirs, block, x, grad,
                                                       [(args.implementation, args.tokens)])[args.implementation]
    theirs_name = f"transformers_{args.implementation}"
    experts_only = ExpertsOnly(ours, x)
    row_grad = torch.randn(experts_only.rows.shape, generator=generator)
    variants = {"ours": lambda: step(ours, x, grad), theirs_name: lambda: step(block, x, grad),
                "experts_only": lambda: experts_only(row_grad)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        names = list(variants)[round_ % 3:] + list(variants)[:round_ % 3]  # the first one rotates
        for name in names:
            times[name].append(step_ms(variants[name], args.iters))
    print(json.dumps({"worst_relative_error": errors,
                      "step_ms": {n: round(statistics.median(t[0] for t in ts), 2) for n, ts in times.items()},
                      "cpu_ms": {n: round(statistics.median(t[1] for t in ts), 2) for n, ts in times.items()},
                      "ours_over_transformers": paired(times, "ours", theirs_name, 0),
                      "ours_over_transformers_cpu": paired(times, "ours", theirs_name, 1), "goal": 0.8,
                      "experts_only_over_transformers": paired(times, "experts_only", theirs_name, 0),
                      "experts_only_over_transformers_cpu": paired(times, "experts_only", theirs_name, 1),
                      "experts": ours.active_paths()["experts"], "shape": vars(args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
