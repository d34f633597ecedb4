"""Typed configuration of a pretraining run: dataclasses loaded from YAML, validated early.

`load_config(path, overrides)` reads YAML strictly (duplicate keys and syntax errors name the file
and line), applies `--section.key=value` overrides, rejects unknown keys with their dotted path,
checks every value's type (`loading`) and returns a `PretrainConfig`. `validate(world_size)`
checks every numeric field's range and the paths (`checks`), then the parallel layout against
the model, before any process group exists; every error names the dotted key, the value and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ...checkpointing.compatibility import upgrade_run_config
from ...pipeline.schedules import DEFAULT_SCHEDULE, SCHEDULE_NAMES
from ...tensor_parallel.linear_functions import OVERLAP_COMM
from ...tensor_parallel.mesh_groups import layout_data_parallel_size
from ...transformer.model_config import ModelConfig
from .checks import (ConfigError, check_blend, check_compile, check_context_parallel, check_data_source, check_experts,
                     check_fp8, check_names, check_ranges, check_resume)
from .pipeline_checks import check_pipeline
from .loading import apply_override, build_dataclass, read_yaml_file
from ..tokenizer import tokenizer_vocab_size

__all__ = ["BlendEntry", "CheckpointConfig", "ConfigError", "DataConfig", "LoggingConfig", "ModelConfig",
           "OptimizerConfig", "ParallelConfig", "PretrainConfig", "ScheduleConfig", "TrainingConfig",
           "config_from_dict", "load_config", "recorded_config", "save_config"]

# One billion tokens a shard, Megatron-LM's practice: 2 GB files in uint16 (4 GB in int32, still one S3 upload),
# about 25 shards for a 100 GB corpus (few files to open and hash), a few MB of index each. A killed preparation
# loses at most the shard it was writing: minutes of work at the millions of tokens per second of 8 encoders.
DEFAULT_SHARD_TOKENS = 1_000_000_000
# data keys that only the preparation of data.source reads: a blend's run never does
PREPARATION_KEYS = ("source", "data_dir", "max_bytes", "text_field", "num_workers", "shard_tokens")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    overlap_comm: bool = OVERLAP_COMM  # column-parallel backward: dX's collective overlaps the dW GEMM
    distributed_backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl with CUDA, else gloo
    timeout_s: float = 600.0
    debug_collectives: bool = False  # record and cross-check every collective (slow; see the README)
    zero_stage: int = 1  # 1: AdamW state sharded across dp ranks (ZeRO-1); 3: params, grads and state (FSDP2); 0: none
    context_parallel_size: int = 1  # cp: the sequence split inside attention (world = dp x cp x tp)
    # all_to_all (Ulysses; measured 3.3x faster than ring at cp 2, s 4096 on CPU) or ring (k/v blocks pass around)
    context_parallel_kind: Literal["ring", "all_to_all"] = "all_to_all"
    # pp: the layers split into stages (world = pp x dp x cp x tp, pp outermost); docs/pipeline.md
    pipeline_parallel_size: int = 1
    pipeline_schedule: Literal[SCHEDULE_NAMES] = DEFAULT_SCHEDULE  # pipeline/schedules.py's registry
    virtual_pipeline_stages: int = 1  # model chunks per pipeline rank (interleaved_1f1b)
    pipeline_layers: list[int] | None = None  # layers per (virtual) stage, e.g. [3, 2]; null: balanced
    # ep: each MoE layer's experts split over this many ranks of the dp x cp group (docs/moe.md)
    expert_parallel_size: int = 1


@dataclass
class BlendEntry:
    """One source of data.blend: a directory prepared by scripts/prepare_data.py, or a Megatron-LM prefix (the
    path of PREFIX.bin and PREFIX.idx without the extension), and its share of the samples (weights need not sum
    to 1: they are normalised)."""

    path: str = ""
    weight: float = 1.0


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
    num_workers: int = 0  # threads that tokenize (0: one per CPU core, up to 8)
    shard_tokens: int = DEFAULT_SHARD_TOKENS  # a prepared shard closes once it holds this many tokens (docs/data.md)
    # packed documents: attention stops at the token files' document boundaries (train.idx), positions restart in
    # each document, and the label that predicts the next document's first token is left out of the loss
    document_masking: bool = False
    # several sources with weights; empty: data_dir alone (a blend of one). Validation comes from every source.
    blend: list[BlendEntry] = field(default_factory=list)
    # epochs: each source's windows in a seeded order per epoch, none repeated before all are read;
    # random_windows: windows drawn with replacement (runs started before 0.3; one source only)
    sampling: Literal["epochs", "random_windows"] = "epochs"
    # where the index caches of Megatron-LM prefixes (and read-only prepared directories) are built once and
    # memory-mapped by every rank (docs/data.md, "Index caches"); None: .index_cache beside logging.run_dir
    index_cache: str | None = None


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
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # autocast dtype, CPU and CUDA alike
    eval_interval: int = 50
    eval_batches: int = 4
    max_skipped_steps: int = 10  # consecutive fp16 loss-scale overflows tolerated (other dtypes: none)
    audit_interval: int = 100  # steps between replicated-parameter audits (0: only at checkpoints)
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"  # the layers' linears' matmuls in FP8 (docs/fp8.md)
    fp8_global_scales: bool = False  # FP8 scales' amax also over dp x cp: every dp and cp layout equals one process


@dataclass
class CheckpointConfig:
    interval: int = 100
    keep_last: int = 2
    resume: str = "auto"  # "auto": newest complete checkpoint if any; "none"; or a step directory
    allow_data_change: bool = False  # resume onto other data (continued pretraining); the tokenizer must match


@dataclass
class LoggingConfig:
    run_dir: str = "runs/gpt_tiny"
    log_interval: int = 10
    progress_bar: bool = True
    tensorboard: bool = True  # used when tensorboard is installed
    peak_tflops: float | None = None  # MFU's denominator; null: a GPU's data sheet or probe, no MFU on a CPU


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
        check_ranges(self)  # every numeric field first: the layout checks below assume sane values
        check_names(self)
        check_data_source(self.data.source)
        check_blend(self.data)
        check_resume(self.checkpoint.resume)
        check_compile(self.model)
        check_fp8(self.training)
        p, m, t = self.parallel.tensor_parallel_size, self.model, self.training
        cp, pp = self.parallel.context_parallel_size, self.parallel.pipeline_parallel_size
        if world_size < 1:
            raise ValueError(f"the world size {world_size} (WORLD_SIZE) must be >= 1: launch with torchrun.")
        stages = {"pipeline_parallel_size": pp} if pp > 1 else {}
        dp = layout_data_parallel_size(
            world_size, {"parallel.tensor_parallel_size": p, "context_parallel_size": cp, **stages},
            "{named} does not divide the world size {world}: launch a multiple of {product} processes "
            "(--nproc-per-node x --nnodes) or change them.")
        check_context_parallel(self)
        check_experts(self, dp * cp)
        m.attention_config().per_rank_heads(p)  # heads / kv heads vs p, with its own messages
        ffn = m.resolved_ffn_hidden_size()
        if ffn % p != 0:
            raise ValueError(f"model.ffn_hidden_size={ffn} is not divisible by tensor_parallel_size={p}.")
        if t.global_batch_size % (t.micro_batch_size * dp) != 0:
            raise ValueError(
                f"training.global_batch_size={t.global_batch_size} is not a multiple of micro_batch_size="
                f"{t.micro_batch_size} x data-parallel size {dp} (world {world_size} / tp {p} / cp {cp} / pp {pp}): "
                f"choose a global batch that is a multiple of {t.micro_batch_size * dp}."
            )
        check_pipeline(self, self.gradient_accumulation_steps(world_size))
        if self.data.seq_len > m.max_seq_len:
            raise ValueError(f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}.")
        if self.parallel.sequence_parallel and self.data.seq_len % p != 0:
            raise ValueError(
                f"parallel.sequence_parallel needs data.seq_len={self.data.seq_len} divisible by "
                f"tensor_parallel_size={p}."
            )
        _check_vocab(self.data, m.vocab_size)
        if self.optimizer.min_lr > self.optimizer.lr:
            raise ValueError(f"optimizer.min_lr={self.optimizer.min_lr} exceeds optimizer.lr={self.optimizer.lr}.")

    def gradient_accumulation_steps(self, world_size: int) -> int:
        """The step's micro-batches per data-parallel rank: the pipeline's micro-batches at pp > 1."""
        par = self.parallel
        dp = world_size // (par.tensor_parallel_size * par.context_parallel_size * par.pipeline_parallel_size)
        return self.training.global_batch_size // (self.training.micro_batch_size * dp)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_vocab(data: DataConfig, model_vocab_size: int) -> None:
    """The tokenizer's vocabulary against model.vocab_size (read from its file for a path)."""
    try:
        tokenizer_vocab = tokenizer_vocab_size(data.tokenizer, data.bpe_vocab_size)
    except ValueError as error:  # the tokenizer module names the spec and the choices; this names the key
        raise ValueError(f"data.tokenizer: {error}") from None
    if model_vocab_size < tokenizer_vocab:
        raise ValueError(f"model.vocab_size={model_vocab_size} is smaller than the {data.tokenizer!r} tokenizer's "
                         f"{tokenizer_vocab} tokens: set model.vocab_size >= {tokenizer_vocab}.")


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> PretrainConfig:
    """Read a YAML config (or the defaults), apply overrides, and type-check everything. Keys of older releases
    are read under today's names with a FutureWarning: a run directory's config.yaml written by 0.1 or 0.2 keeps
    resuming (checkpointing.compatibility)."""
    data = read_yaml_file(path) if path is not None else {}
    for override in overrides:
        apply_override(data, override)
    return build_dataclass(PretrainConfig, upgrade_run_config(data, warn=True), "")


def config_from_dict(data: dict[str, Any]) -> PretrainConfig:
    """The config saved in a run directory or checkpoint manifest, checked like a YAML file.

    Keys of the release that wrote it are read under today's names (checkpointing.compatibility) without a
    warning: the user cannot edit a checkpoint's manifest."""
    return build_dataclass(PretrainConfig, upgrade_run_config(data), "")


def save_config(cfg: PretrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), encoding="utf-8")


def recorded_config(config: dict) -> dict:
    """A run's config (PretrainConfig.to_dict()) as its config.yaml records it: a blend's without the keys it never
    reads, so that it does not claim a data.source (the default `stdlib`) it never trained on."""
    if not config["data"]["blend"]:
        return config
    return {**config, "data": {k: v for k, v in config["data"].items() if k not in PREPARATION_KEYS}}
