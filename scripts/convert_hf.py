"""Import a Hugging Face model as a checkpoint of this project, or export a checkpoint as one.

    python scripts/convert_hf.py import --hf path/to/hf_model --out runs/imported --tp 2 [--ep 2] [--tokenizer PATH]
    python scripts/convert_hf.py export --checkpoint runs/imported --out path/to/hf_export

import reads a save_pretrained directory (config.json + model.safetensors, or shards with
model.safetensors.index.json; LlamaForCausalLM, MistralForCausalLM or GPT2LMHeadModel), whatever
its vocabulary, and writes
    RUN/checkpoints/step_0000000/   the weights at tensor_parallel_size=--tp (no optimizer state)
    RUN/config.yaml                 the run config: defaults, the model from config.json, --tp, --ep
                                    (a mixture of experts' expert_parallel_size; the checkpoint holds every
                                    expert whole whatever it is),
                                    data.tokenizer=RUN/tokenizer, data.data_dir=RUN/data
    RUN/tokenizer/                  tokenizer.json, tokenizer_config.json, special_tokens_map.json
                                    as found beside the weights (or --tokenizer PATH: a tokenizer.json or
                                    a directory holding one): the model's own tokenizer, used by
                                    training on text (set data.source) and by generate.py
    RUN/hf_config.json              the source config.json: export keeps its architecture and token ids
A directory without tokenizer.json (and no --tokenizer) imports all the same, with a warning and a note
RUN/tokenizer/MISSING: training on text then stops at the config check (data.tokenizer names a directory
that holds only the note, and the error says so) and generation says how to give one (copy the tokenizer.json there, or set
data.tokenizer / pass --tokenizer).

export takes a run directory (its newest complete checkpoint) or a step directory, at any
tensor-parallel size, and writes config.json + model.safetensors that
transformers.AutoModelForCausalLM.from_pretrained loads, and beside them the files of RUN/tokenizer/.
The architecture is --architecture, else the one recorded at import (RUN/hf_config.json), else the
one the model's shape implies.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

from parallel_attention.checkpointing import read_canonical_checkpoint, resolve_step_dir, write_canonical_checkpoint
from parallel_attention.hf import FAMILY, canonical_to_hf, hf_to_canonical, read_hf_config
from parallel_attention.hf.config import read_json_object
from parallel_attention.hf.convert import MISSING_TOKENIZER_NOTE, missing_tokenizer_message
from parallel_attention.launch.warning_lines import one_line_warnings
from parallel_attention.training import (DataConfig, LoggingConfig, ModelConfig, ParallelConfig, PretrainConfig,
                                         save_config)
from parallel_attention.training.tokenizer import copy_tokenizer as copy_tokenizer_files, tokenizer_file

SOURCE_CONFIG = "hf_config.json"


def build_run_config(model: ModelConfig, tp: int, run_dir: Path, ep: int = 1) -> PretrainConfig:
    """Defaults, the imported model, tensor_parallel_size=tp and expert_parallel_size=ep, data prepared in RUN/data
    with RUN/tokenizer."""
    seq_len = min(DataConfig.seq_len, model.max_seq_len)
    data = DataConfig(tokenizer=str(run_dir / "tokenizer"), data_dir=str(run_dir / "data"), seq_len=seq_len)
    cfg = PretrainConfig(model=model, parallel=ParallelConfig(tensor_parallel_size=tp, expert_parallel_size=ep),
                         data=data, logging=LoggingConfig(run_dir=str(run_dir)))
    # the layout only: the tokenizer is not written yet (and may be missing); any vocabulary is accepted
    dataclasses.replace(cfg, model=dataclasses.replace(model, vocab_size=max(model.vocab_size, 256)),
                        data=dataclasses.replace(data, tokenizer="byte")).validate(world_size=tp * ep)
    return cfg


def copy_tokenizer(hf_dir: Path, run_dir: Path, tokenizer: Path | None = None) -> None:
    """Copy the tokenizer (`tokenizer`: a tokenizer.json or a directory holding one; else the one beside the weights)
    into RUN/tokenizer/, which data.tokenizer names. Without one, leave a note there instead and warn: data.tokenizer
    then names a directory without a tokenizer.json, which stops training on text before it starts (naming the
    note), and generate.py says what the note says."""
    tokenizer_dir = run_dir / "tokenizer"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer is None and not (hf_dir / "tokenizer.json").is_file():
        note = f"{missing_tokenizer_message(run_dir)}.\n(no tokenizer.json in {hf_dir} at import)\n"
        (tokenizer_dir / MISSING_TOKENIZER_NOTE).write_text(note, encoding="utf-8")
        print(f"warning: {hf_dir} has no tokenizer.json, so {run_dir} has no tokenizer (see "
              f"{tokenizer_dir / MISSING_TOKENIZER_NOTE}): import again with --tokenizer PATH, or copy its "
              f"tokenizer.json into {tokenizer_dir}/ before training or generating", file=sys.stderr)
        return
    (tokenizer_dir / MISSING_TOKENIZER_NOTE).unlink(missing_ok=True)  # from an earlier import into this run
    copy_tokenizer_files(tokenizer_file(tokenizer or hf_dir), tokenizer_dir)


def run_import(hf_dir: Path, run_dir: Path, tp: int, tokenizer: Path | None = None, ep: int = 1) -> Path:
    ckpt_root = run_dir / "checkpoints"
    if ckpt_root.exists() and any(ckpt_root.iterdir()):
        raise ValueError(f"{ckpt_root} already holds checkpoints: import into a new run directory.")
    model, canonical = hf_to_canonical(hf_dir)
    cfg = build_run_config(model, tp, run_dir, ep)
    copy_tokenizer(hf_dir, run_dir, tokenizer)
    step_dir = write_canonical_checkpoint(ckpt_root, cfg.to_dict(), canonical, step=0)
    save_config(cfg, run_dir / "config.yaml")
    (run_dir / SOURCE_CONFIG).write_text(json.dumps(read_hf_config(hf_dir), indent=2) + "\n", encoding="utf-8")
    return step_dir


def run_export(checkpoint: Path, out_dir: Path, architecture: str | None) -> Path:
    step_dir = resolve_step_dir(checkpoint)
    saved, canonical = read_canonical_checkpoint(step_dir)
    model = ModelConfig.from_dict(saved["model"])
    run_dir = step_dir.parent.parent  # RUN/checkpoints/step_XXXXXXX -> RUN
    in_run = step_dir.parent.name == "checkpoints"
    recorded = run_dir / SOURCE_CONFIG
    source = read_json_object(recorded) if in_run and recorded.is_file() else None
    out = canonical_to_hf(model, canonical, out_dir, architecture, source)
    tokenizer_dir = run_dir / "tokenizer"
    for path in sorted(tokenizer_dir.iterdir()) if in_run and tokenizer_dir.is_dir() else []:
        if path.is_file() and path.name != MISSING_TOKENIZER_NOTE:
            shutil.copyfile(path, out / path.name)
    return out


def main(argv: list[str]) -> int:
    one_line_warnings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="Hugging Face directory -> run directory with a checkpoint")
    imp.add_argument("--hf", required=True, type=Path, help="save_pretrained directory")
    imp.add_argument("--out", required=True, type=Path, help="run directory to create")
    imp.add_argument("--tp", required=True, type=int, help="tensor_parallel_size of the checkpoint")
    imp.add_argument("--ep", type=int, default=1, help="expert_parallel_size of the run config (MoE; default 1)")
    imp.add_argument("--tokenizer", type=Path, default=None,
                     help="tokenizer.json (or a directory holding one) to copy into RUN/tokenizer/; default: the one "
                          "beside the weights")
    exp = commands.add_parser("export", help="checkpoint -> Hugging Face directory")
    exp.add_argument("--checkpoint", required=True, type=Path, help="run directory or step directory")
    exp.add_argument("--out", required=True, type=Path, help="new (or empty) directory to write")
    exp.add_argument("--architecture", choices=sorted(FAMILY), default=None,
                     help="default: the one recorded at import, else what the model's shape implies")
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            written = run_import(args.hf, args.out, args.tp, args.tokenizer, args.ep)
        else:
            written = run_export(args.checkpoint, args.out, args.architecture)
    except (ValueError, OSError) as error:  # CheckpointError, TensorFileError: ValueErrors naming their file
        print(f"cannot {args.command}: {error}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
