"""Typed configuration of a pretraining run: dataclasses loaded from YAML, validated early.

`load_config(path, overrides)` reads YAML with `yaml.safe_load`, rejects unknown keys with
their dotted path, checks every value's type, applies `--section.key=value` overrides, and
returns a `PretrainConfig`. `validate(world_size)` checks the parallel layout against the
model before any process group exists; every error names the values and the fix.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ..transformer.model_config import ModelConfig, migrate_renamed_keys
from .tokenizer import BPE_MIN_VOCAB, tokenizer_vocab_size


class ConfigError(ValueError):
    """The run config cannot work; the message names the key, its value and the fix."""


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    distributed_backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl with CUDA, else gloo
    timeout_s: float = 600.0

    RENAMED = {"backend": "distributed_backend"}  # 0.1.0's name, still read with a warning


@dataclass
class DataConfig:
    source: str = "stdlib"  # "stdlib": this interpreter's standard-library sources; or a file, or a directory
    # searched recursively for text files (.txt, .md, .py, ...), .jsonl and .parquet: one document per file/line/row
    tokenizer: str = "byte"  # "byte" | "gpt2" (cached tiktoken) | "bpe" (trained on the corpus) | tokenizer.json path
    data_dir: str = "data/stdlib_byte"  # where prepare_data writes train.bin / val.bin / meta.json
    val_fraction: float = 0.02
    max_bytes: int | None = 8_000_000  # cap on the corpus read (None: all of it)
    seq_len: int = 128
    bpe_vocab_size: int = 8192  # tokens of the byte-level BPE that tokenizer=bpe trains
    text_field: str = "text"  # the field of a .jsonl object / column of a .parquet file holding the text
    num_workers: int = 0  # processes that tokenize (0: one per CPU core, up to 8)


@dataclass
class OptimizerConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # by the global norm; 0 disables


@dataclass
class ScheduleConfig:
    warmup_steps: int = 20
    decay: Literal["cosine", "constant"] = "cosine"


@dataclass
class TrainingConfig:
    max_steps: int = 300
    global_batch_size: int = 16  # sequences per optimizer step, across data-parallel ranks
    micro_batch_size: int = 8  # sequences per forward on one rank
    seed: int = 1234
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # autocast dtype on GPUs
    eval_interval: int = 50
    eval_batches: int = 4


@dataclass
class CheckpointConfig:
    interval: int = 100
    keep_last: int = 2
    resume: str = "auto"  # "auto": newest complete checkpoint if any; "none"; or a step directory


@dataclass
class LoggingConfig:
    run_dir: str = "runs/gpt_tiny"
    log_interval: int = 10
    progress_bar: bool = True
    tensorboard: bool = True  # used when tensorboard is installed


@dataclass
class PretrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self, world_size: int) -> None:
        """Check the whole run against `world_size` processes; raise ConfigError naming the fix."""
        try:
            self._check(world_size)
        except ConfigError:
            raise
        except ValueError as error:  # AttentionConfig and friends raise plain ValueErrors
            raise ConfigError(str(error)) from None

    def _check(self, world_size: int) -> None:
        p, m, t = self.parallel.tensor_parallel_size, self.model, self.training
        _positive(self, world_size)
        if world_size % p != 0:
            raise ValueError(
                f"parallel.tensor_parallel_size={p} does not divide the world size {world_size}: launch a "
                f"multiple of {p} processes (--nproc-per-node x --nnodes) or change tensor_parallel_size."
            )
        m.attention_config(self.parallel.sequence_parallel).per_rank_heads(p)  # heads / kv heads vs p, with its own messages
        ffn = m.resolved_ffn_hidden_size()
        if ffn % p != 0:
            raise ValueError(f"model.ffn_hidden_size={ffn} is not divisible by tensor_parallel_size={p}.")
        dp = world_size // p
        if t.global_batch_size % (t.micro_batch_size * dp) != 0:
            raise ValueError(
                f"training.global_batch_size={t.global_batch_size} is not a multiple of micro_batch_size="
                f"{t.micro_batch_size} x data-parallel size {dp} (world {world_size} / tp {p}): "
                f"choose a global batch that is a multiple of {t.micro_batch_size * dp}."
            )
        if self.data.seq_len > m.max_seq_len:
            raise ValueError(f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}.")
        if self.parallel.sequence_parallel and self.data.seq_len % p != 0:
            raise ValueError(
                f"parallel.sequence_parallel needs data.seq_len={self.data.seq_len} divisible by "
                f"tensor_parallel_size={p}."
            )
        if not 0 <= m.hidden_dropout < 1:
            raise ValueError(f"model.hidden_dropout={m.hidden_dropout} must lie in [0, 1).")
        _check_data(self.data, m.vocab_size)
        if self.optimizer.min_lr > self.optimizer.lr:
            raise ValueError(f"optimizer.min_lr={self.optimizer.min_lr} exceeds optimizer.lr={self.optimizer.lr}.")

    def gradient_accumulation_steps(self, world_size: int) -> int:
        dp = world_size // self.parallel.tensor_parallel_size
        return self.training.global_batch_size // (self.training.micro_batch_size * dp)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive(cfg: PretrainConfig, world_size: int) -> None:
    checks = {"model.hidden_size": cfg.model.hidden_size, "model.num_layers": cfg.model.num_layers,
              "model.vocab_size": cfg.model.vocab_size, "parallel.tensor_parallel_size":
              cfg.parallel.tensor_parallel_size, "data.seq_len": cfg.data.seq_len,
              "training.max_steps": cfg.training.max_steps, "training.micro_batch_size":
              cfg.training.micro_batch_size, "training.global_batch_size": cfg.training.global_batch_size,
              "checkpoint.interval": cfg.checkpoint.interval, "checkpoint.keep_last": cfg.checkpoint.keep_last,
              "logging.log_interval": cfg.logging.log_interval, "training.eval_interval":
              cfg.training.eval_interval, "world size": world_size}
    for name, value in checks.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be a positive integer.")


def _check_data(data: DataConfig, model_vocab_size: int) -> None:
    """The data settings, and the tokenizer's vocabulary against model.vocab_size (read from its file for a path)."""
    if data.max_bytes is not None and data.max_bytes < 1:
        raise ValueError(f"data.max_bytes={data.max_bytes} must be positive, or null for the whole corpus.")
    if not 0 < data.val_fraction < 1:
        raise ValueError(f"data.val_fraction={data.val_fraction} must lie in (0, 1).")
    if data.num_workers < 0:
        raise ValueError(f"data.num_workers={data.num_workers} must be 0 (one per CPU core) or a process count.")
    if data.tokenizer == "bpe" and data.bpe_vocab_size < BPE_MIN_VOCAB:
        raise ValueError(f"data.bpe_vocab_size={data.bpe_vocab_size} is below {BPE_MIN_VOCAB} (256 byte symbols "
                         f"and the end-of-text token): set data.bpe_vocab_size >= {BPE_MIN_VOCAB}.")
    tokenizer_vocab = tokenizer_vocab_size(data.tokenizer, data.bpe_vocab_size)  # ValueError naming a bad spec
    if model_vocab_size < tokenizer_vocab:
        raise ValueError(f"model.vocab_size={model_vocab_size} is smaller than the {data.tokenizer!r} tokenizer's "
                         f"{tokenizer_vocab} tokens: set model.vocab_size >= {tokenizer_vocab}.")


# ---------------------------------------------------------------------- loading
def _check_type(path: str, value: Any, annotation: Any) -> Any:
    """Return `value` if it fits `annotation` (ints are accepted for floats), else raise."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            try:
                return _check_type(path, value, option)
            except ValueError:
                pass
        raise ValueError(f"{path}={value!r} has type {type(value).__name__}; expected {_type_name(annotation)}.")
    if origin is Literal:
        if value not in typing.get_args(annotation):
            raise ValueError(f"{path}={value!r} is not one of {list(typing.get_args(annotation))}.")
        return value
    if annotation is type(None):
        if value is None:
            return None
    elif annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif annotation is float and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    elif annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif annotation in (bool, str) and isinstance(value, annotation):
        return value
    raise ValueError(f"{path}={value!r} has type {type(value).__name__}; expected {_type_name(annotation)}.")


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is Literal:
        return "one of " + str(list(typing.get_args(annotation)))
    return "null" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def _build(cls, data: dict[str, Any], prefix: str, warn: bool = True):
    if not isinstance(data, dict):
        raise ValueError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}.")
    data = migrate_renamed_keys(cls, data, prefix.rstrip(".") or "config", warn=warn)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = ", ".join(f"{prefix}{k}" for k in unknown)
        raise ValueError(f"unknown config key(s): {where}; known keys here: {', '.join(sorted(names))}.")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{prefix}{name}.", warn)
        else:
            kwargs[name] = _check_type(f"{prefix}{name}", value, hint)
    return cls(**kwargs)


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply `section.key=value` (leading dashes allowed); the value is parsed as YAML."""
    text = override.lstrip("-")
    if "=" not in text:
        raise ValueError(f"override {override!r} must look like --section.key=value.")
    dotted, raw = text.split("=", 1)
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {override!r}: {key} is not a section.")
    node[keys[-1]] = yaml.safe_load(raw) if raw != "" else ""


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> PretrainConfig:
    """Read a YAML config (or the defaults), apply overrides, and type-check everything."""
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text(encoding="utf-8")
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping of sections.")
    for override in overrides:
        apply_override(data, override)
    return _build(PretrainConfig, data, "")


def config_from_dict(data: dict[str, Any]) -> PretrainConfig:
    """The config saved in a run directory or checkpoint manifest, checked like a YAML file.

    Keys renamed since it was written are read under their new names without a warning: the
    user cannot edit a checkpoint's manifest."""
    return _build(PretrainConfig, data, "", warn=False)


def save_config(cfg: PretrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), encoding="utf-8")
