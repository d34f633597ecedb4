"""Long-context training steps side by side: one step (forward, backward, AdamW) of a small Llama-style model.

    OMP_NUM_THREADS=1 python benchmarks/benchmark_long_context.py [--seq-len 4096] [--document-len 512] \
        [--rounds 7] [--warmup 1] [--variants NAME ...] --out OUT.json
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/benchmark_long_context.py --out OUT.json

Model (issue 25's speed target): h 128, 2 layers, 4 heads / 2 k/v heads (head dim 32), rotary, RMSNorm, SwiGLU,
b 1, float32, one thread. Variants, each a (name -> builder) entry of VARIANTS, built once, then timed in
alternating rounds (each round runs every variant once, the order rotated per round):
    no_documents    the batch as one sequence (causal attention over all s tokens)
    documents       the same tokens with document_ids of --document-len tokens each: attention inside each
                    document only, the masked-out blocks skipped (transformer/documents.py, causal_chunks.py)
Under torchrun with 2 ranks (context_parallel_size 2), also:
    cp2_all_to_all, cp2_ring                        the same step at cp = 2 (each rank its zigzag half)
    cp2_all_to_all_documents, cp2_ring_documents    the same with the documents
and the cp = 1 variants run on rank 0 alone (a cp group of itself) while rank 1 waits at the step's closing
all-reduce: gloo's wait blocks in the kernel, so rank 0 has a core to itself, as a one-process launch would,
and the cp = 1 step is timed in the same rounds, next to the cp = 2 ones, under the same load (the convention
of benchmark_training.py's transformers_p1). Every step starts at a barrier; its time is the slowest rank's.
Rank 0 writes the JSON: per variant step_ms {median, q1, q3, n} and rounds_ms; ratios {a_over_b: ratio of the
medians} and paired_ratios {a_over_b: median of the per-round ratios} for every pair; the settings and the
torch version.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import parallel_attention as pa
from parallel_attention import GPTModel, ModelConfig
from parallel_attention.tensor_parallel.mesh_groups import new_groups
from parallel_attention.tensor_parallel.parallel_state import shutdown_distributed


def llama_config(seq_len: int) -> ModelConfig:
    return ModelConfig(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       activation="swiglu", norm="rmsnorm", position_embedding="rotary", max_seq_len=seq_len,
                       tie_embeddings=False, qkv_bias=False, out_bias=False, mlp_bias=False)


def _training_step(seq_len: int, document_ids: torch.Tensor | None, **model_kwargs):
    """A closure running one training step of a freshly seeded model on a fixed batch (model_kwargs: GPTModel's
    cp_group=, context_parallel_kind=)."""
    torch.manual_seed(0)
    model = GPTModel(llama_config(seq_len), **model_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (1, seq_len + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = model(inputs, labels, document_ids=document_ids)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def _document_ids(args) -> torch.Tensor:
    return (torch.arange(args.seq_len) // args.document_len).unsqueeze(0)


def _idle() -> None:
    """A rank outside a cp = 1 variant's one-rank world: nothing to do but wait for rank 0."""


def _alone(args, document_ids):
    """The cp = 1 step: in one process, or on rank 0 of a torchrun world (a cp group of itself; the others idle)."""
    if args.world == 1:
        return _training_step(args.seq_len, document_ids)
    if dist.get_rank() != 0:
        return _idle
    return _training_step(args.seq_len, document_ids, cp_group=args.alone)


def no_documents(args):
    return _alone(args, None)


def documents(args):
    return _alone(args, _document_ids(args))


def _context_parallel(kind: str, with_documents: bool):
    def build(args):
        ids = _document_ids(args) if with_documents else None
        return _training_step(args.seq_len, ids, context_parallel_kind=kind)
    return build


VARIANTS = {"no_documents": no_documents, "documents": documents}
CP_VARIANTS = {f"cp2_{kind}{suffix}": _context_parallel(kind, bool(suffix))
               for kind in ("all_to_all", "ring") for suffix in ("", "_documents")}
VARIANTS.update(CP_VARIANTS)


def _summary(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median": statistics.median(times), "q1": q[0], "q3": q[2], "n": len(times)}


def _timed(step) -> float:
    """ms of one step, the slowest rank's (under torchrun: from a barrier to the step's end on every rank)."""
    if not dist.is_initialized():
        started = time.perf_counter()
        step()
        return (time.perf_counter() - started) * 1e3
    dist.barrier()
    started = time.perf_counter()
    step()
    elapsed = torch.tensor([(time.perf_counter() - started) * 1e3], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def time_alternating(steps: dict, rounds: int, warmup: int) -> dict[str, list[float]]:
    """ms per step of each variant per round; round r starts at variant r mod n (rotating the order)."""
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            _timed(steps[name])
    rounds_ms = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rounds_ms[name].append(_timed(steps[name]))
    return rounds_ms


def _ratios(rounds_ms: dict[str, list[float]]) -> tuple[dict, dict]:
    """(ratio of the medians, median of the per-round ratios) for every ordered pair of variants."""
    medians = {name: statistics.median(t) for name, t in rounds_ms.items()}
    pairs = [(a, b) for a in rounds_ms for b in rounds_ms if a != b]
    return ({f"{a}_over_{b}": medians[a] / medians[b] for a, b in pairs},
            {f"{a}_over_{b}": statistics.median(x / y for x, y in zip(rounds_ms[a], rounds_ms[b])) for a, b in pairs})


def _start(args) -> None:
    """A torchrun world of 2: cp = 2 over both ranks, and each rank's own one-rank group for the cp = 1 steps."""
    args.world = int(os.environ.get("WORLD_SIZE", "1"))
    args.alone = None
    if args.world == 1:
        return
    if args.world != 2:
        raise SystemExit(f"WORLD_SIZE={args.world}: run in one process or under torchrun --nproc-per-node 2.")
    pa.init_distributed(context_parallel_size=2)
    args.alone = new_groups(torch.arange(2).view(-1, 1), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--document-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                        help="default: every variant this world runs (the cp2_ ones under torchrun, 2 ranks)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error(f"--rounds {args.rounds}: the medians need at least 5 rounds.")
    _start(args)
    names = args.variants or [n for n in VARIANTS if args.world == 2 or n not in CP_VARIANTS]
    if args.world == 1 and set(names) & set(CP_VARIANTS):
        parser.error(f"--variants {sorted(set(names) & set(CP_VARIANTS))}: context parallelism needs "
                     "torchrun --standalone --nproc-per-node 2.")
    torch.set_num_threads(1)
    rounds_ms = time_alternating({name: VARIANTS[name](args) for name in names}, args.rounds, args.warmup)
    ratios, paired = _ratios(rounds_ms)
    report = {"settings": {"seq_len": args.seq_len, "document_len": args.document_len, "batch": 1,
                           "rounds": args.rounds, "warmup": args.warmup, "threads": torch.get_num_threads(),
                           "world_size": args.world, "torch": torch.__version__,
                           "machine": platform.processor() or platform.machine()},
              "step_ms": {name: _summary(t) for name, t in rounds_ms.items()}, "rounds_ms": rounds_ms,
              "ratios": ratios, "paired_ratios": paired}
    if not dist.is_initialized() or dist.get_rank() == 0:
        args.out.write_text(json.dumps(report, indent=2))
        print(json.dumps({"step_ms": {n: round(s["median"], 1) for n, s in report["step_ms"].items()},
                          "paired_ratios": {k: round(v, 3) for k, v in paired.items()}}))
    if dist.is_initialized():
        shutdown_distributed()


if __name__ == "__main__":
    main()
