"""Sample text from a pretraining checkpoint at any tensor-parallel size that divides the model
(the launched process count is the tensor-parallel size; weights are resharded on load).

    torchrun --standalone --nproc-per-node 2 scripts/generate.py --checkpoint runs/gpt_tiny \
        --prompt "import os" --max-new-tokens 200 --temperature 0.8 --top-k 40

--checkpoint takes a run directory (its newest complete checkpoint) or one step directory.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import parallel_attention as pa
from parallel_attention.checkpointing import read_canonical_checkpoint, resolve_step_dir
from parallel_attention.training import config_from_dict
from parallel_attention.transformer import GPTModel, generate
from parallel_attention.training import get_tokenizer


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="run directory or step_XXXXXXX directory")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole sequence at every step")
    parser.add_argument("--print-tokens", action="store_true", help="also print the token ids")
    args = parser.parse_args(argv)

    step_dir = resolve_step_dir(args.checkpoint)
    saved, canonical = read_canonical_checkpoint(step_dir)  # written at any p
    cfg = config_from_dict(saved)
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    device = pa.init_distributed(tensor_model_parallel_size=tp)
    model = GPTModel(cfg.model, sequence_parallel=False, device=device)  # decoding runs without SP
    model.load_canonical_state_dict(canonical)
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    prompt = torch.tensor([tokenizer.encode(args.prompt)], device=device)
    out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                   use_cache=not args.no_cache)
    if torch.distributed.get_rank() == 0:
        print(f"# checkpoint {step_dir} (trained at tensor_parallel_size={cfg.parallel.tensor_parallel_size}), "
              f"generating at tensor_parallel_size={tp}", file=sys.stderr)
        if args.print_tokens:
            print("tokens:", " ".join(map(str, out[0].tolist())))
        print(tokenizer.decode(out[0].tolist()))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
