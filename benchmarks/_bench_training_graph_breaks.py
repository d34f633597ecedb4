"""List the torch.compile graph breaks of one transformer layer (what model.compile compiles), per layout.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/_bench_training_graph_breaks.py \
        [--sequence-parallel] [--dropout 0.1]

torch._dynamo.explain on layer 0's forward (a 32-wide, 4-head layer; the breaks depend on the code path,
not the size); rank 0 prints the graph and break counts and each distinct reason with where it happens.
"""

from __future__ import annotations

import argparse
import collections
import os

import torch
import torch._dynamo as dynamo

from parallel_attention.tensor_parallel import parallel_state as ps
from parallel_attention.tensor_parallel.rng import dropout_coordinates, manual_seed
from parallel_attention.transformer.model import GPTModel
from parallel_attention.transformer.model_config import ModelConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout")
    args = ap.parse_args()
    p = int(os.environ.get("WORLD_SIZE", "1"))
    device = ps.init_distributed(p)
    manual_seed(0)
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_heads=4, max_seq_len=32, hidden_dropout=args.dropout,
                      attention_dropout=args.dropout)
    layer = GPTModel(cfg, args.sequence_parallel, device=device).layers[0]
    x = torch.randn(32 // (p if args.sequence_parallel else 1), 2, 32, device=device, requires_grad=True)
    with dropout_coordinates(0, 0, 0):
        out = dynamo.explain(layer)(x)
    if ps.get_global_rank() == 0:
        print(f"p={p} sequence_parallel={args.sequence_parallel} dropout={args.dropout}: "
              f"{out.graph_count} graphs, {out.graph_break_count} breaks")
        where = collections.Counter(
            (b.reason.splitlines()[0], " <- ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno}"
                                                   for f in b.user_stack[-2:])) for b in out.break_reasons)
        for (reason, stack), n in where.items():
            print(f"  {n}x {reason}  [{stack}]")
    ps.shutdown_distributed()  # the groups, then the process group: none of gloo's threads outlives the exit


if __name__ == "__main__":
    main()
