"""Import a Hugging Face model as a checkpoint of this project, or export a checkpoint as one.

    python scripts/convert_hf.py import --hf path/to/hf_model --out runs/imported --tp 2
    python scripts/convert_hf.py export --checkpoint runs/imported --out path/to/hf_export

import reads a save_pretrained directory (config.json + model.safetensors, or shards with
model.safetensors.index.json; LlamaForCausalLM, MistralForCausalLM or GPT2LMHeadModel) and writes
    RUN/checkpoints/step_0000000/   the weights at tensor_parallel_size=--tp (no optimizer state)
    RUN/config.yaml                 the run config: defaults, the model from config.json, --tp
    RUN/hf_config.json              the source config.json: export keeps its architecture and token ids
The data section keeps its defaults except the tokenizer, which must cover the vocabulary: "gpt2"
when vocab_size >= 50257, else "byte" (a vocabulary under 256 tokens is refused). Neither is the
imported model's own tokenizer unless it is GPT-2's: set data.* before training on text.

export takes a run directory (its newest complete checkpoint) or a step directory, at any
tensor-parallel size, and writes config.json + model.safetensors that
transformers.AutoModelForCausalLM.from_pretrained loads. The architecture is --architecture, else
the one recorded at import (RUN/hf_config.json), else the one the model's shape implies.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from parallel_attention.checkpointing import read_canonical_checkpoint, resolve_step_dir, write_canonical_checkpoint
from parallel_attention.training import (DataConfig, LoggingConfig, ModelConfig, ParallelConfig, PretrainConfig,
                                       save_config)
from parallel_attention.hf import FAMILY, canonical_to_hf, hf_to_canonical, read_hf_config

SOURCE_CONFIG = "hf_config.json"


def build_run_config(model: ModelConfig, tp: int, run_dir: Path) -> PretrainConfig:
    """Defaults, the imported model, tensor_parallel_size=tp, and a tokenizer that covers the vocabulary."""
    if model.vocab_size < 256:
        raise ValueError(f"vocab_size={model.vocab_size} is smaller than the byte tokenizer's 256 tokens: this "
                         "project's data pipeline has no tokenizer for it.")
    seq_len = min(DataConfig.seq_len, model.max_seq_len)
    data = DataConfig(tokenizer="gpt2", data_dir="data/stdlib_gpt2", seq_len=seq_len) if model.vocab_size >= 50257 \
        else DataConfig(seq_len=seq_len)
    cfg = PretrainConfig(model=model, parallel=ParallelConfig(tensor_parallel_size=tp), data=data,
                         logging=LoggingConfig(run_dir=str(run_dir)))
    cfg.validate(world_size=tp)
    return cfg


def run_import(hf_dir: Path, run_dir: Path, tp: int) -> Path:
    ckpt_root = run_dir / "checkpoints"
    if ckpt_root.exists() and any(ckpt_root.iterdir()):
        raise ValueError(f"{ckpt_root} already holds checkpoints: import into a new run directory.")
    model, canonical = hf_to_canonical(hf_dir)
    cfg = build_run_config(model, tp, run_dir)
    step_dir = write_canonical_checkpoint(ckpt_root, cfg.to_dict(), canonical, step=0)
    save_config(cfg, run_dir / "config.yaml")
    (run_dir / SOURCE_CONFIG).write_text(json.dumps(read_hf_config(hf_dir), indent=2) + "\n", encoding="utf-8")
    return step_dir


def run_export(checkpoint: Path, out_dir: Path, architecture: str | None) -> Path:
    step_dir = resolve_step_dir(checkpoint)
    saved, canonical = read_canonical_checkpoint(step_dir)
    model = ModelConfig.from_dict(saved["model"])
    recorded = step_dir.parent.parent / SOURCE_CONFIG  # RUN/checkpoints/step_XXXXXXX -> RUN/hf_config.json
    source = json.loads(recorded.read_text(encoding="utf-8")) if recorded.is_file() else None
    return canonical_to_hf(model, canonical, out_dir, architecture, source)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="Hugging Face directory -> run directory with a checkpoint")
    imp.add_argument("--hf", required=True, type=Path, help="save_pretrained directory")
    imp.add_argument("--out", required=True, type=Path, help="run directory to create")
    imp.add_argument("--tp", required=True, type=int, help="tensor_parallel_size of the checkpoint")
    exp = commands.add_parser("export", help="checkpoint -> Hugging Face directory")
    exp.add_argument("--checkpoint", required=True, type=Path, help="run directory or step directory")
    exp.add_argument("--out", required=True, type=Path, help="new (or empty) directory to write")
    exp.add_argument("--architecture", choices=sorted(FAMILY), default=None,
                     help="default: the one recorded at import, else what the model's shape implies")
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            written = run_import(args.hf, args.out, args.tp)
        else:
            written = run_export(args.checkpoint, args.out, args.architecture)
    except ValueError as error:  # CheckpointError is a ValueError too
        print(f"cannot {args.command}: {error}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
