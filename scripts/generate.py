"""Sample text from a pretraining checkpoint, at the tensor-parallel size it was trained with.

    torchrun --standalone --nproc-per-node 2 scripts/generate.py --checkpoint runs/gpt_tiny \
        --prompt "def main(" --max-new-tokens 200 --temperature 0.8 --top-k 40

--checkpoint takes a run directory (its newest complete checkpoint) or one step directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import parallel_attention as pa
from parallel_attention.checkpoint import latest_checkpoint, load_model_weights
from parallel_attention.config import config_from_dict
from parallel_attention.generation import generate
from parallel_attention.model import GPTModel
from parallel_attention.training.tokenizer import get_tokenizer


def resolve_step_dir(path: Path) -> Path:
    """A step directory as given, or the newest complete one of a run (or its checkpoints/) directory."""
    if (path / "manifest.json").exists():
        return path
    for root in (path / "checkpoints", path):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    raise SystemExit(f"no complete checkpoint under {path}: pass a run directory or a step_XXXXXXX directory.")


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

    step_dir = resolve_step_dir(Path(args.checkpoint))
    cfg = config_from_dict(json.loads((step_dir / "manifest.json").read_text())["config"])
    device = pa.init_distributed(tensor_model_parallel_size=cfg.parallel.tensor_parallel_size)
    model = GPTModel(cfg.model, sequence_parallel=False, device=device)  # decoding runs without SP
    manifest = load_model_weights(step_dir, model)
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    prompt = torch.tensor([tokenizer.encode(args.prompt)], device=device)
    out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                   use_cache=not args.no_cache)
    if torch.distributed.get_rank() == 0:
        print(f"# checkpoint {step_dir} (step {manifest['step']}), tensor_parallel_size="
              f"{cfg.parallel.tensor_parallel_size}", file=sys.stderr)
        if args.print_tokens:
            print("tokens:", " ".join(map(str, out[0].tolist())))
        print(tokenizer.decode(out[0].tolist()))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
