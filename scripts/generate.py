"""Sample text from a pretraining checkpoint at any tensor-parallel size that divides the model
(the launched process count is the tensor-parallel size; weights are resharded on load).

    torchrun --standalone --nproc-per-node 2 scripts/generate.py --checkpoint runs/gpt_tiny --prompt "import os" --max-new-tokens 200 --temperature 0.8 --top-k 40

--checkpoint takes a run directory (its newest complete checkpoint) or one step directory.
Prompts: --prompt (repeatable) and --prompt-file (one prompt per line, blank lines skipped), in that
order; prompts of the same token length are sampled as one batch. For each prompt, in order, stdout
gets `tokens: ID ID ...` (with --print-tokens) and then the prompt and its continuation, decoded;
with several prompts a line `-----` separates them.
Any --max-new-tokens works: past the model's max_seq_len the context slides (its last max_seq_len
tokens). Generation stops early at the tokenizer's end-of-sequence token, when it has one.
The tokenizer is --tokenizer, else RUN/tokenizer/ (a model's own, copied there at import or by
training), else the checkpoint's data.tokenizer.
Bad arguments: rank 0 prints one `error: ...` line, first, and every rank exits with status 2 (torchrun
itself then reports, its root cause (rank 0) repeating the line, and exits 1).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path

import parallel_attention as pa
from parallel_attention.launch.warning_lines import one_line_warnings
from parallel_attention.checkpointing import read_canonical_checkpoint, resolve_step_dir
from parallel_attention.hf import missing_tokenizer_message, tokenizer_is_missing
from parallel_attention.training import PretrainConfig, TokenizerUnavailableError, config_from_dict, get_tokenizer
from parallel_attention.launch.agreement import disagreements
from parallel_attention.training.data.read.data_identity import check_tokenizer
from parallel_attention.tensor_parallel.parallel_state import shutdown_distributed
from parallel_attention.training.run.summary import millions
from parallel_attention.launch.launcher_watch import stop_with_launcher
from parallel_attention.launch.rank_zero import is_rank_zero
from parallel_attention.launch.report_once import record_errors, report_from_rank_0
from parallel_attention.transformer import GPTModel, generate_batch


class UsageError(ValueError):
    """A bad command line; argparse's own exit is replaced so that only rank 0 reports it."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="run directory (its newest complete checkpoint) or step_XXXXXXX directory")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default 'def ' without --prompt-file")
    parser.add_argument("--prompt-file", type=Path, help="a text file with one prompt per line")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="tokens to sample (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=40, help="0: no top-k filtering (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole context at every step")
    parser.add_argument("--print-tokens", action="store_true", help="also print the token ids")
    parser.add_argument("--tokenizer", help="byte, gpt2, or a tokenizer.json (or its directory); default: the run's")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="seconds before a collective that a rank never joins fails (default: the run's "
                             "parallel.timeout_s)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens={args.max_new_tokens} must be >= 0.")
    if args.temperature < 0:
        raise UsageError(f"--temperature={args.temperature} must be >= 0 (0 is greedy).")
    if args.top_k < 0:
        raise UsageError(f"--top-k={args.top_k} must be >= 0 (0 turns top-k filtering off).")
    return args


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            raise UsageError(f"--prompt-file={args.prompt_file} is not a file: give a text file, one prompt per line.")
        lines = args.prompt_file.read_text(encoding="utf-8").splitlines()
        prompts += [line for line in lines if line.strip()]
        if not prompts:
            raise UsageError(f"--prompt-file={args.prompt_file} holds no prompt: write one prompt per line.")
    return prompts if prompts else ["def "]


def check_checkpoint_exists(path: str) -> None:
    """A --checkpoint that does not exist (a typo, or no run yet) says so, with the nearest name beside it."""
    given = Path(path)
    if given.exists():
        return
    siblings = [p.name for p in given.parent.iterdir() if p.is_dir()] if given.parent.is_dir() else []
    near = difflib.get_close_matches(given.name, siblings, n=1)
    where = "" if given.is_absolute() else f" (relative to {Path.cwd()})"
    hint = f" Did you mean {given.parent / near[0]}?" if near else ""
    raise UsageError(f"--checkpoint={path}: no such directory{where}.{hint} Pretraining writes it: "
                     "scripts/pretrain.py saves checkpoints under its logging.run_dir (RUN/checkpoints/step_XXXXXXX); "
                     "pass that run directory or one of its step directories.")


def load_tokenizer(spec: str | None, step_dir: Path, cfg: PretrainConfig):
    """--tokenizer, else the run's tokenizer/ directory, else the checkpoint's data.tokenizer."""
    if spec is not None:
        return get_tokenizer(spec, cfg.data.data_dir)
    run_dir = step_dir.parent.parent if step_dir.parent.name == "checkpoints" else None
    if run_dir is not None and (run_dir / "tokenizer" / "tokenizer.json").is_file():
        return get_tokenizer(str(run_dir / "tokenizer"))
    try:
        return get_tokenizer(cfg.data.tokenizer, cfg.data.data_dir)
    except (ValueError, TokenizerUnavailableError):
        if run_dir is not None and tokenizer_is_missing(run_dir):
            raise ValueError(missing_tokenizer_message(run_dir) + ", or pass --tokenizer PATH") from None
        raise


def encode_prompts(tokenizer, prompts: list[str], vocab_size: int) -> list[list[int]]:
    encoded = [tokenizer.encode(p) for p in prompts]
    for i, (text, ids) in enumerate(zip(prompts, encoded)):
        if not ids:
            raise UsageError(f"prompt {i + 1} ({text!r}) encodes to no tokens: give a non-empty prompt.")
        if max(ids) >= vocab_size:
            raise UsageError(f"prompt {i + 1} encodes to token id {max(ids)}, outside this model's vocab_size="
                             f"{vocab_size}: tokenizer {tokenizer.name} does not belong to it; pass --tokenizer.")
    return encoded


def prepare(argv: list[str], tp: int):
    """Everything that can fail on bad input, checked before any process group exists."""
    args = parse_args(argv)
    if args.timeout_s is not None and not args.timeout_s > 0:
        raise UsageError(f"--timeout-s={args.timeout_s} must be positive (seconds).")
    prompts = read_prompts(args)
    check_checkpoint_exists(args.checkpoint)
    step_dir = resolve_step_dir(args.checkpoint)
    saved, canonical = read_canonical_checkpoint(step_dir)  # written at any p
    cfg = config_from_dict(saved)
    cfg.model.attention_config().per_rank_heads(tp)  # raises naming num_heads / num_kv_heads and p
    if cfg.model.resolved_ffn_hidden_size() % tp != 0:
        raise ValueError(f"model ffn_hidden_size={cfg.model.resolved_ffn_hidden_size()} is not divisible by "
                         f"{tp} processes: launch a number of processes that divides it.")
    tokenizer = load_tokenizer(args.tokenizer, step_dir, cfg)
    check_tokenizer(step_dir, tokenizer)  # the checkpoint's own, by its sha256
    return args, step_dir, cfg, canonical, tokenizer, encode_prompts(tokenizer, prompts, cfg.model.vocab_size)


def decode(tokenizer, ids: list[int]) -> str:
    """Text of `ids` without a final end-of-sequence token and without ids the tokenizer does not know."""
    if ids and ids[-1] == tokenizer.eot_token:
        ids = ids[:-1]
    return tokenizer.decode([i for i in ids if i < tokenizer.vocab_size])


@record_errors  # an error no refusal caught: torchrun's root cause is its one line
def main(argv: list[str]) -> int:
    one_line_warnings()
    stop_with_launcher()  # under torchrun: a worker whose launcher dies stops at once
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args, step_dir, cfg, canonical, tokenizer, prompts = prepare(argv, tp)
    except (ValueError, OSError, TokenizerUnavailableError) as error:  # CheckpointError is a ValueError
        report_from_rank_0(f"error: {error}")
        return 2
    try:
        return _generate(args, step_dir, cfg, canonical, tokenizer, prompts, tp)
    finally:
        shutdown_distributed()  # on every way out: a live gloo group at exit can abort with SIGABRT


def _layout(cfg: PretrainConfig) -> str:
    par = cfg.parallel
    stages = f" x pipeline_parallel_size={par.pipeline_parallel_size}" if par.pipeline_parallel_size > 1 else ""
    return f"tensor_parallel_size={par.tensor_parallel_size}{stages}"


def _generate(args, step_dir, cfg, canonical, tokenizer, prompts, tp: int) -> int:
    """Join the process group, check that every rank has the same arguments, decode, print on rank 0."""
    device = pa.init_distributed(tensor_model_parallel_size=tp, timeout=args.timeout_s or cfg.parallel.timeout_s)
    differing = disagreements({**vars(args), "checkpoint": str(step_dir.resolve()), "version": pa.__version__})
    if differing:  # a rank launched with other arguments would sample other tokens, or hang
        report_from_rank_0("error: arguments differ across ranks:\n" + "\n".join(differing))
        return 2
    model = GPTModel(cfg.model, sequence_parallel=False, tp_group=pa.get_tensor_model_parallel_group(),
                     device=device)  # decoding runs without SP
    model.load_canonical_state_dict(canonical)
    outputs = generate_batch(model, prompts, args.max_new_tokens, args.temperature, args.top_k or None, args.seed,
                             use_cache=not args.no_cache, eos_token_id=tokenizer.eot_token, device=device)
    if is_rank_zero():
        size = millions(sum(t.numel() for t in canonical.values()))  # every stage's weights, a tied table once
        print(f"# checkpoint {step_dir} ({size} parameters, trained at {_layout(cfg)}), generating at "
              f"tensor_parallel_size={tp}" + (", one pipeline stage" if cfg.parallel.pipeline_parallel_size > 1 else ""),
              file=sys.stderr)
        for i, out in enumerate(outputs):
            if i > 0:
                print("-----")
            if args.print_tokens:
                print("tokens:", " ".join(map(str, out)))
            print(decode(tokenizer, out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
