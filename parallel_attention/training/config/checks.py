"""Range checks of a run config, made before any process group exists.

Every numeric field of `PretrainConfig` has one entry in `RANGES`: the values that mean something.
Ranges are about meaning, not taste: the learning rate must be finite and >= 0 but has no upper
bound (a huge rate is the user's call; the divergence guard catches what follows), while `norm_eps`
must be > 0 because 0 divides by zero on a constant input. Every error names the dotted key, the
value, the range with what the value means, and the fix.

Paths are checked here too: `data.source` and `checkpoint.resume` (or `--resume`) must exist.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ...checkpointing.format import MANIFEST
from ..tokenizer import BPE_MIN_VOCAB


class ConfigError(ValueError):
    """The run config cannot work; the message names the key, its value and the fix."""


@dataclass(frozen=True)
class Range:
    """The meaningful values of one numeric field: low..high, each end open or closed; floats finite."""

    low: float
    high: float = math.inf
    low_open: bool = False  # True: `low` itself is refused
    high_open: bool = False
    null: str = ""  # what null means, when null is allowed
    meaning: str = ""  # why the range is what it is, for the error message

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        return (f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                f"{')' if self.high_open else ']'}")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


COUNT = Range(1)
PROBABILITY = Range(0, 1, high_open=True, meaning="a probability; 1 would drop everything")
BETA = Range(0, 1, high_open=True, meaning="an exponential moving-average factor; 1 never updates")
EPSILON = Range(0, low_open=True, meaning="added to keep a division finite; 0 divides by zero")
MAX_TIMEOUT_S = datetime.timedelta.max.total_seconds()  # the longest timeout a process group can represent

RANGES: dict[str, Range] = {
    "model.vocab_size": COUNT,
    "model.hidden_size": COUNT,
    "model.num_layers": COUNT,
    "model.num_heads": COUNT,
    "model.num_kv_heads": Range(1, null="num_heads (multi-head attention)"),
    "model.head_dim": Range(1, null="hidden_size / num_heads"),
    "model.ffn_hidden_size": Range(1, null="4 hidden_size (gelu) or 8/3 hidden_size (swiglu)"),
    "model.norm_eps": EPSILON,
    "model.max_seq_len": COUNT,
    "model.rope_theta": Range(0, low_open=True, meaning="the base of the rotary frequencies"),
    "model.rope_factor": Range(0, low_open=True, meaning="llama3 rope scaling: the low frequencies' divisor"),
    "model.rope_low_freq_factor": Range(0, low_open=True, meaning="llama3 rope scaling: original length / it is "
                                                                  "the longest wavelength kept unscaled"),
    "model.rope_high_freq_factor": Range(0, low_open=True, meaning="llama3 rope scaling: original length / it is "
                                                                   "the shortest wavelength scaled"),
    "model.rope_original_max_seq_len": Range(1, meaning="llama3 rope scaling: the unscaled model's context length"),
    "model.hidden_dropout": PROBABILITY,
    "model.attention_dropout": PROBABILITY,
    "model.init_std": Range(0, low_open=True, meaning="the standard deviation of the initial weights"),
    "model.num_experts": Range(0, meaning="0: every MLP dense"),
    "model.moe_top_k": COUNT,
    "model.moe_ffn_hidden_size": Range(1, null="ffn_hidden_size"),
    "model.moe_shared_expert_ffn_hidden_size": Range(0, meaning="0: no shared expert"),
    "model.moe_router_bias_update_rate": Range(0, meaning="0: no balancing bias"),
    "model.moe_aux_loss_coeff": Range(0),
    "model.moe_z_loss_coeff": Range(0),
    "model.moe_layer_freq": COUNT,
    "model.moe_first_dense_layers": Range(0),
    "model.moe_capacity_factor": Range(0, low_open=True, null="dropless"),
    "parallel.tensor_parallel_size": COUNT,
    "parallel.context_parallel_size": COUNT,
    "parallel.pipeline_parallel_size": COUNT,
    "parallel.expert_parallel_size": COUNT,
    "parallel.virtual_pipeline_stages": COUNT,
    "parallel.timeout_s": Range(0, MAX_TIMEOUT_S, low_open=True, meaning="seconds a collective may wait"),
    "parallel.zero_stage": Range(0, 3, meaning="0: every data-parallel rank holds the whole optimizer state; "
                                               "1: it is sharded across them (ZeRO-1); 3: parameters, gradients "
                                               "and optimizer state are sharded (FSDP2)"),
    "data.val_fraction": Range(0, 1, low_open=True, high_open=True,
                               meaning="the share of tokens held out; both splits must be non-empty"),
    "data.max_bytes": Range(1, null="the whole corpus"),
    "data.seq_len": COUNT,
    "data.bpe_vocab_size": Range(BPE_MIN_VOCAB, meaning="256 byte symbols and the end-of-text token at least"),
    "data.num_workers": Range(0, meaning="0: one thread per CPU core, up to 8"),
    "data.shard_tokens": Range(1, meaning="the tokens after which a prepared shard closes"),
    "optimizer.lr": Range(0, meaning="no upper bound: a huge rate is your call"),
    "optimizer.min_lr": Range(0),
    "optimizer.weight_decay": Range(0),
    "optimizer.beta1": BETA,
    "optimizer.beta2": BETA,
    "optimizer.eps": EPSILON,
    "optimizer.grad_clip": Range(0, meaning="the largest global gradient norm; 0 disables clipping"),
    "schedule.warmup_steps": Range(0),
    "training.max_steps": COUNT,
    "training.global_batch_size": COUNT,
    "training.micro_batch_size": COUNT,
    "training.seed": Range(0, 2 ** 63, high_open=True, meaning="a generator seed"),
    "training.eval_interval": COUNT,
    "training.eval_batches": Range(1, meaning="the validation loss is the mean over these batches"),
    "training.max_skipped_steps": Range(0, meaning="consecutive fp16 overflow steps tolerated"),
    "training.audit_interval": Range(0, meaning="0: audit replicated parameters only at checkpoints"),
    "checkpoint.interval": COUNT,
    "checkpoint.keep_last": Range(1, meaning="the checkpoint just written is always kept"),
    "logging.log_interval": COUNT,
    "logging.peak_tflops": Range(0, low_open=True, null="the GPU's bf16 peak by name, else a measured GEMM rate",
                                 meaning="the device's peak TFLOP/s that MFU divides by"),
}


def numeric_fields(cfg: Any) -> dict[str, type]:
    """Dotted key -> int or float, for every numeric field (`int`, `float`, `int | None`, ...) of the sections."""
    found = {}
    for section in dataclasses.fields(cfg):
        hints = typing.get_type_hints(type(getattr(cfg, section.name)))
        for item in dataclasses.fields(getattr(cfg, section.name)):
            options = typing.get_args(hints[item.name]) or (hints[item.name],)
            kind = next((t for t in (int, float) if t in options), None)
            if kind is not None and typing.get_origin(hints[item.name]) is not Literal:
                found[f"{section.name}.{item.name}"] = kind
    return found


def check_ranges(cfg: Any) -> None:
    """Raise ConfigError for the first numeric field outside its range in `RANGES`."""
    kinds = numeric_fields(cfg)
    for key, allowed in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is None and allowed.null:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and allowed.contains(value):
            continue
        what = "an integer" if kinds.get(key) is int else "a finite number"
        notes = "; ".join(n for n in (allowed.meaning, allowed.null and f"null: {allowed.null}") if n)
        raise ConfigError(f"{key}={value!r} is out of range: it must be {what} {allowed.describe()}"
                          f"{' or null' if allowed.null else ''}{f' ({notes})' if notes else ''}; "
                          f"set it in the config file or with --{key}=VALUE.")
    if cfg.parallel.zero_stage == 2:
        raise ConfigError("parallel.zero_stage=2 is not supported: use 1 (optimizer state sharded, ZeRO-1) or 3 "
                          "(parameters, gradients and optimizer state sharded with FSDP2); set "
                          "--parallel.zero_stage=1 or --parallel.zero_stage=3.")


def check_data_source(source: str) -> None:
    if source != "stdlib" and not Path(source).exists():
        raise ConfigError(f"data.source={source!r} does not exist: give an existing file or directory of text, "
                          f"or 'stdlib' for this interpreter's standard-library sources.")


def check_resume(where: str, key: str = "checkpoint.resume") -> None:
    """`auto`, `none` or an existing step directory (one that holds manifest.json)."""
    if where in ("auto", "none"):
        return
    path = Path(where)
    if not (path / MANIFEST).is_file():
        state = "has no " + MANIFEST if path.is_dir() else "does not exist"
        raise ConfigError(f"{key}={where!r} {state}: give 'auto' (the newest complete checkpoint of "
                          f"logging.run_dir), 'none', or a complete step directory such as "
                          f"<run_dir>/checkpoints/step_0000100.")


def check_compile(model: Any) -> None:
    """model.compile with layout-invariant dropout: inductor cannot compile its 64-bit mask hash (integer overflow
    in the generated code), so the combination is refused instead of failing at the first step."""
    if model.compile and model.dropout_rng == "layout_invariant" and (model.hidden_dropout or model.attention_dropout):
        raise ConfigError("model.compile=true cannot compile model.dropout_rng='layout_invariant' dropout: set "
                          "--model.compile=false, --model.dropout_rng=per_rank, or the dropouts to 0.")


def check_fp8(training: Any) -> None:
    """training.fp8_global_scales reduces the FP8 scales' amax: meaningless, so refused, without FP8."""
    if training.fp8_global_scales and training.fp8 == "none":
        raise ConfigError("training.fp8_global_scales=true needs FP8 linears: set --training.fp8=tensorwise (or "
                          "rowwise), or --training.fp8_global_scales=false.")


def check_names(cfg: Any) -> None:
    """Paths and names that an empty string would silently turn into the working directory."""
    for key in ("data.data_dir", "data.text_field", "logging.run_dir"):
        section, name = key.split(".")
        if not getattr(getattr(cfg, section), name).strip():
            raise ConfigError(f"{key} is empty: give it a name (see configs/gpt_tiny.yaml).")


def check_experts(cfg: Any, data_context_size: int) -> None:
    """The mixture-of-experts keys against each other and the layout (docs/moe.md)."""
    m, ep = cfg.model, cfg.parallel.expert_parallel_size
    if m.num_experts == 0:
        if ep > 1:
            raise ConfigError(f"parallel.expert_parallel_size={ep} needs MoE layers: set model.num_experts.")
        return
    if m.moe_top_k > m.num_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} exceeds model.num_experts={m.num_experts}.")
    if m.num_experts % ep:
        raise ConfigError(f"model.num_experts={m.num_experts} is not divisible by parallel.expert_parallel_size={ep}.")
    if data_context_size % ep:
        raise ConfigError(f"parallel.expert_parallel_size={ep} must divide the data x context-parallel size "
                          f"{data_context_size}: the expert-parallel group folds over those ranks.")


def check_context_parallel(cfg: Any) -> None:
    """parallel.context_parallel_size / _kind against the model, the data and the other settings."""
    par, m = cfg.parallel, cfg.model
    cp, tp, kind = par.context_parallel_size, par.tensor_parallel_size, par.context_parallel_kind
    if cp == 1:
        return
    chunks = 2 * cp * (tp if par.sequence_parallel else 1)
    if cfg.data.seq_len % chunks != 0:
        under = f" x tensor_parallel_size={tp} (sequence_parallel)" if par.sequence_parallel else ""
        raise ValueError(f"parallel.context_parallel_size={cp} needs data.seq_len={cfg.data.seq_len} divisible by 2 x "
                         f"context_parallel_size{under} = {chunks} (the zigzag split): change data.seq_len.")
    if (m.attention_dropout > 0 or m.hidden_dropout > 0) and m.dropout_rng != "layout_invariant":
        raise ValueError(f"parallel.context_parallel_size={cp} with dropout (model.attention_dropout="
                         f"{m.attention_dropout}, model.hidden_dropout={m.hidden_dropout}) needs "
                         f"model.dropout_rng=layout_invariant (got {m.dropout_rng}): the per_rank generators would "
                         "draw the same masks on every context-parallel rank. Set --model.dropout_rng=layout_invariant "
                         "or the dropouts to 0.")
    if kind == "all_to_all" and (m.num_heads // tp) % cp != 0:
        raise ValueError(f"parallel.context_parallel_kind=all_to_all needs the heads per tensor-parallel rank "
                         f"(model.num_heads={m.num_heads} / tp {tp}) divisible by context_parallel_size={cp}: "
                         "choose another cp, or context_parallel_kind=ring.")


def check_blend(data) -> None:
    """data.blend: each entry a path that exists (a directory, or a Megatron-LM prefix's .bin and .idx) with a
    positive weight; random_windows reads one source only; no data.source beside it (a blend never reads it)."""
    if data.blend and data.source != "stdlib":  # stdlib: the default, which a config need not have set
        raise ConfigError(f"data.source={data.source!r} and data.blend are both set, but a blend trains on its "
                          "entries only and never reads data.source: prepare the source ahead of time (python "
                          f"scripts/prepare_data.py --source {data.source} --out DIR) and add DIR to data.blend, or "
                          "drop data.blend to train on data.source alone.")
    for i, entry in enumerate(data.blend):
        key = f"data.blend[{i}]"
        if not math.isfinite(entry.weight) or entry.weight <= 0:
            raise ConfigError(f"{key}.weight={entry.weight} must be a positive number (weights are normalised, so "
                              "0.7 / 0.3 and 7 / 3 mean the same); leave a source out rather than weigh it 0.")
        path = Path(entry.path)
        if not entry.path or not (path.is_dir() or Path(f"{path}.bin").is_file() and Path(f"{path}.idx").is_file()):
            raise ConfigError(f"{key}.path={entry.path!r} is neither a directory nor a Megatron-LM prefix with "
                              f"{entry.path}.bin and {entry.path}.idx: prepare it with scripts/prepare_data.py "
                              "--out PATH, or give the prefix of an indexed dataset without its extension.")
    if data.sampling == "random_windows" and len(data.blend) > 1:
        raise ConfigError(f"data.sampling=random_windows reads a single source and data.blend names "
                          f"{len(data.blend)}: use data.sampling=epochs for a blend.")
