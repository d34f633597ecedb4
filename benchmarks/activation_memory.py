"""Activation memory per transformer layer: measured saved-for-backward bytes, our formula, Korthikanti et al.

    OMP_NUM_THREADS=1 python benchmarks/activation_memory.py --out act_p1.json
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/activation_memory.py --out act_p2.json

For each style (gpt2: learned positions, GELU, LayerNorm, MHA; llama: rotary, SwiGLU, RMSNorm, GQA), each
recomputation (none, selective, full) and, at p > 1, without and with sequence parallelism, one layer's
bytes are saved(2 layers) - saved(1 layer) over one forward (`saved_activation_bytes`: the embedding, the
head and the loss cancel), on rank 0 (every rank holds the same sizes). Next to them:
`layer_activation_bytes` (our layer's terms, docs/performance.md) and Korthikanti et al. 2022's count
for a GPT layer with flash-style attention (no s x s scores) in fp16, 34 s b h / t with TP + SP, here for
float32 and no dropout: the 2-byte terms double, the two 1-byte dropout masks go: 64 s b h / t with SP,
s b h (16 + 48 / t) without, 64 s b h at p = 1.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import parallel_attention as pa
from parallel_attention.tensor_parallel.parallel_state import shutdown_distributed
from parallel_attention.training.activation_memory import layer_activation_bytes, measured_layer_bytes
from parallel_attention.transformer import ModelConfig

STYLES = {
    "gpt2": dict(position_embedding="learned", activation="gelu", norm="layernorm"),
    "llama": dict(position_embedding="rotary", activation="swiglu", norm="rmsnorm", qkv_bias=False, out_bias=False,
                  mlp_bias=False, tie_embeddings=False),
}
RECOMPUTE = {"none": {}, "selective": {"recompute_activations": True, "recompute_granularity": "selective"},
             "full": {"recompute_activations": True, "recompute_granularity": "full"}}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4, help="k/v heads of the llama style (gpt2: --heads)")
    parser.add_argument("--kernel", default="auto", choices=("auto", "sdpa", "math"),
                        help="attention kernel; the formula holds for SDPA (math keeps the s x s probabilities)")
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    return parser.parse_args()


def korthikanti_fp32(s: int, b: int, h: int, p: int, sp: bool) -> int:
    """Korthikanti et al. 2022, Table 2 (no stored scores), for float32 activations and no dropout masks."""
    if sp:
        return 64 * s * b * h // p
    return 16 * s * b * h + 48 * s * b * h // p


def rows(args, p: int) -> list[dict]:
    s, b, h = args.seq, args.batch, args.hidden
    out = []
    for style, spec in STYLES.items():
        kv = args.kv_heads if style == "llama" else args.heads
        for sp in ([False, True] if p > 1 else [False]):
            for name, recompute in RECOMPUTE.items():
                cfg = ModelConfig(vocab_size=256, hidden_size=h, num_heads=args.heads, num_kv_heads=kv,
                                  max_seq_len=s, attention_kernel=args.kernel, **spec, **recompute)
                measured = measured_layer_bytes(cfg, s, b, sp)
                formula = layer_activation_bytes(cfg, s, b, p, sp, name)
                out.append({"style": style, "p": p, "sequence_parallel": sp, "recompute": name,
                            "measured_bytes": measured, "formula_bytes": formula,
                            "korthikanti_fp32_bytes": korthikanti_fp32(s, b, h, p, sp),
                            "measured_over_sbh": measured / (s * b * h)})
    return out


def main() -> None:
    args = parse_args()
    p = int(os.environ.get("WORLD_SIZE", "1"))
    pa.init_distributed(tensor_model_parallel_size=p)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = rows(args, p)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"s={args.seq} b={args.batch} h={args.hidden} heads={args.heads} kernel={args.kernel} float32; "
              "MiB per layer")
        print("| style | p | SP | recompute | measured | formula | Korthikanti fp32 | measured / (s b h) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in result:
            mib = [r[k] / 2**20 for k in ("measured_bytes", "formula_bytes", "korthikanti_fp32_bytes")]
            print(f"| {r['style']} | {r['p']} | {'yes' if r['sequence_parallel'] else 'no'} | {r['recompute']} | "
                  f"{mib[0]:.3f} | {mib[1]:.3f} | {mib[2]:.3f} | {r['measured_over_sbh']:.3f} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "rows": result}, f, indent=1)
    shutdown_distributed()  # the groups, then the process group: none of gloo's threads outlives the exit


if __name__ == "__main__":
    main()
