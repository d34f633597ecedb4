"""Activation memory per transformer layer: measured saved-for-backward bytes, our formula, Korthikanti et al.

    OMP_NUM_THREADS=1 python benchmarks/activation_memory.py --out act_p1.json
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/activation_memory.py --out act_p2.json
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/activation_memory.py --cp 2 --out act_cp2.json

For each style (gpt2: learned positions, GELU, LayerNorm, MHA; llama: rotary, SwiGLU, RMSNorm, GQA), each
recomputation (none, selective, full) and, at p > 1, without and with sequence parallelism, one layer's
bytes are saved(2 layers) - saved(1 layer) over one forward (`saved_activation_bytes`: the embedding, the
head and the loss cancel), on rank 0 (every rank holds the same sizes). Next to them:
`layer_activation_bytes` (our layer's terms, docs/performance.md) and Korthikanti et al. 2022's count
for a GPT layer with flash-style attention (no s x s scores) in fp16, 34 s b h / t with TP + SP, here for
float32 and no dropout: the 2-byte terms double, the two 1-byte dropout masks go: 64 s b h / t with SP,
s b h (16 + 48 / t) without, 64 s b h at p = 1.

--cp C (context parallelism; tp = world / C): each row is this rank's part (s / C tokens) under each
context_parallel_kind (all_to_all, ring), next to the same layer measured at cp = 1 in the same run (a cp group
of this rank alone, the same tp): `over_cp1` = measured / that. The formula is the layer's at s / C tokens
(all_to_all keeps q, k, v and the output as [b, heads / C, s, d], the same bytes as [b, heads, s / C, d]; the
ring keeps this rank's q, k, v, output and logsumexp). Measured, the layer keeps 4 (s / C) b h bytes more than
that: the attention output twice, the core's for its backward and the dense's [s / C, b, h] input (at cp = 1 one
storage; under CP the all-to-all, or the ring's [b, heads, s / C, d] layout, makes the dense's a copy);
all_to_all's selective recomputation drops the core's.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import parallel_attention as pa
from parallel_attention.tensor_parallel.mesh_groups import new_groups
from parallel_attention.tensor_parallel.parallel_state import shutdown_distributed
from parallel_attention.training.activation_memory import layer_activation_bytes, measured_layer_bytes
from parallel_attention.transformer import ModelConfig

STYLES = {
    "gpt2": dict(position_embedding="learned", activation="gelu", norm="layernorm"),
    "llama": dict(position_embedding="rotary", activation="swiglu", norm="rmsnorm", qkv_bias=False, out_bias=False,
                  mlp_bias=False, tie_embeddings=False),
}
KINDS = ("all_to_all", "ring")
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
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (tensor-parallel: world / cp)")
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    return parser.parse_args()


def korthikanti_fp32(s: int, b: int, h: int, p: int, sp: bool) -> int:
    """Korthikanti et al. 2022, Table 2 (no stored scores), for float32 activations and no dropout masks."""
    if sp:
        return 64 * s * b * h // p
    return 16 * s * b * h + 48 * s * b * h // p


def _row(style: str, cfg: ModelConfig, args, layout: tuple[int, int, bool], name: str, kind: str | None,
         cp1_bytes: int | None) -> dict:
    """One row: `style`'s layer under recomputation `name` at layout (p, cp, sp), context-parallel `kind`."""
    p, cp, sp = layout
    s, b, h = args.seq, args.batch, args.hidden
    measured = measured_layer_bytes(cfg, s, b, sp, **({} if cp == 1 else {"context_parallel_kind": kind}))
    row = {"style": style, "p": p, "cp": cp, "context_parallel_kind": kind,
           "sequence_parallel": sp, "recompute": name, "measured_bytes": measured,
           "formula_bytes": layer_activation_bytes(cfg, s // cp, b, p, sp, name),
           "korthikanti_fp32_bytes": korthikanti_fp32(s, b, h, p, sp) // cp,
           "measured_over_sbh": measured / (s * b * h)}
    if cp1_bytes is not None:
        row["cp1_measured_bytes"], row["over_cp1"] = cp1_bytes, measured / cp1_bytes
    return row


def rows(args, p: int, cp: int = 1, alone=None) -> list[dict]:
    out = []
    for style, spec in STYLES.items():
        kv = args.kv_heads if style == "llama" else args.heads
        for sp in ([False, True] if p > 1 else [False]):
            for name, recompute in RECOMPUTE.items():
                cfg = ModelConfig(vocab_size=256, hidden_size=args.hidden, num_heads=args.heads, num_kv_heads=kv,
                                  max_seq_len=args.seq, attention_kernel=args.kernel, **spec, **recompute)
                # at cp > 1, the same layer without context parallelism: this rank alone in its cp group
                cp1 = measured_layer_bytes(cfg, args.seq, args.batch, sp, cp_group=alone) if cp > 1 else None
                for kind in (KINDS if cp > 1 else (None,)):
                    out.append(_row(style, cfg, args, (p, cp, sp), name, kind, cp1))
    return out


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.cp < 1 or world % args.cp != 0:
        raise SystemExit(f"--cp {args.cp} does not divide the world size {world}: launch a multiple of it.")
    p = world // args.cp
    pa.init_distributed(tensor_model_parallel_size=p, context_parallel_size=args.cp)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    alone = new_groups(torch.arange(world).view(-1, 1), None) if args.cp > 1 else None  # every rank's own
    result = rows(args, p, args.cp, alone)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"s={args.seq} b={args.batch} h={args.hidden} heads={args.heads} kernel={args.kernel} float32; "
              "MiB per layer and rank")
        print("| style | p | cp | kind | SP | recompute | measured | formula | Korthikanti fp32 | measured / (s b h) "
              "| / cp = 1 |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in result:
            mib = [r[k] / 2**20 for k in ("measured_bytes", "formula_bytes", "korthikanti_fp32_bytes")]
            print(f"| {r['style']} | {r['p']} | {r['cp']} | {r['context_parallel_kind'] or '-'} | "
                  f"{'yes' if r['sequence_parallel'] else 'no'} | {r['recompute']} | {mib[0]:.3f} | {mib[1]:.3f} | "
                  f"{mib[2]:.3f} | {r['measured_over_sbh']:.3f} | {r.get('over_cp1', 1.0):.3f} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "rows": result}, f, indent=1)
    shutdown_distributed()  # the groups, then the process group: none of gloo's threads outlives the exit


if __name__ == "__main__":
    main()
