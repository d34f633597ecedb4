"""The one-screen summary a run prints at start (global rank 0): what is trained, how, on what, where.

    run summary
      model        0.84M parameters, 0.43M on each rank
      shape        4 layers, hidden 128, 4 heads (4 k/v, head dim 32), ffn 512 gelu, layernorm, ...
      layout       world 4 = tensor parallel 2 x data parallel 2
      batch        global 16 sequences = micro 8 x data parallel 2 x 1 accumulation step(s)
      tokens       2,048 per step (sequences of 128), 819,200 in 400 steps
      ...
      peak         989 TFLOP/s per device (the data sheet's dense bf16 peak): MFU's denominator

Pure text from the config and the built model, no communication: the total counts the canonical
(unsharded, unpadded) weights, "on each rank" what this rank holds (vocabulary padding included). The peak
is the one the ranks agreed on at start (`flops.agree_peak_tflops`); a step that runs faster raises it,
which metrics.jsonl's `peak_tflops` records. On a CPU without `logging.peak_tflops` the line says why there is none.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..config.schema import PretrainConfig
from ..flops import peak_source, peak_tflops
from ..precision import Precision
from .pipeline_summary import buffer_row, pipeline_rows, total_parameters
from .moe_summary import moe_rows


def millions(n: int) -> str:
    """A parameter count as the summary and generate.py print it: 0.84M, or 9,216 below 10,000."""
    return f"{n / 1e6:.2f}M" if n >= 10_000 else f"{n:,}"


def _size_line(model: torch.nn.Module, cfg: PretrainConfig) -> str:
    here = sum(math.prod(shape) for shape in model.canonical_shapes().values())
    local = sum(p.numel() for p in model.parameters())
    if model.stage.chunks is not None:  # a pipeline stage's: the stages row gives every stage's
        return (f"{millions(total_parameters(cfg))} parameters, {millions(here)} on pipeline stage 0, "
                f"{millions(local)} on each of its ranks")
    return f"{millions(here)} parameters, {millions(local)} on each rank"


def _shape_line(cfg: PretrainConfig) -> str:
    m, attention = cfg.model, cfg.model.attention_config()
    return (f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads ({attention.num_kv_heads} k/v, "
            f"head dim {attention.head_dim}), ffn {m.resolved_ffn_hidden_size()} {m.activation}, {m.norm}, "
            f"{m.position_embedding} positions, vocab {m.vocab_size}")


def _data_parallel(cfg: PretrainConfig, world_size: int) -> int:
    par = cfg.parallel
    return world_size // (par.tensor_parallel_size * par.context_parallel_size * par.pipeline_parallel_size)


def _layout_line(cfg: PretrainConfig, world_size: int) -> str:
    par = cfg.parallel
    p, cp, pp = par.tensor_parallel_size, par.context_parallel_size, par.pipeline_parallel_size
    context = f" x context parallel {cp} ({cfg.parallel.context_parallel_kind})" if cp > 1 else ""
    stages = f"pipeline parallel {pp} x " if pp > 1 else ""
    dp = _data_parallel(cfg, world_size)
    text = f"world {world_size} = {stages}tensor parallel {p}{context} x data parallel {dp}"
    experts = f", expert parallel {par.expert_parallel_size} (over dp x cp)" if par.expert_parallel_size > 1 else ""
    return text + (" + sequence parallel" if cfg.parallel.sequence_parallel else "") + experts


def _batch_line(cfg: PretrainConfig, world_size: int) -> str:
    t, dp = cfg.training, _data_parallel(cfg, world_size)
    what = "micro-batches through the pipeline" if cfg.parallel.pipeline_parallel_size > 1 else "accumulation step(s)"
    return (f"global {t.global_batch_size} sequences = micro {t.micro_batch_size} x data parallel {dp} x "
            f"{cfg.gradient_accumulation_steps(world_size)} {what}")


def _tokens_line(cfg: PretrainConfig) -> str:
    per_step = cfg.training.global_batch_size * cfg.data.seq_len
    return (f"{per_step:,} per step (sequences of {cfg.data.seq_len}), {per_step * cfg.training.max_steps:,} "
            f"in {cfg.training.max_steps} steps")


def _data_line(cfg: PretrainConfig) -> str:
    d = cfg.data
    what = f"{d.source} in {d.data_dir}" if not d.blend else f"a blend of {len(d.blend)} sources"
    return f"{what}, {d.tokenizer} tokenizer, {d.sampling} sampling"


def _peak_line(cfg: PretrainConfig, device: torch.device) -> str:
    peak, source = peak_tflops(cfg.logging.peak_tflops, device), peak_source(cfg.logging.peak_tflops, device)
    return source if peak is None else f"{peak:.4g} TFLOP/s per device ({source}): MFU's denominator"


def run_summary(cfg: PretrainConfig, model: torch.nn.Module, world_size: int,
                device: torch.device | str = "cpu", blend: str | None = None) -> str:
    """A few lines: model size, parallel layout, batch and tokens per step, data, outputs, precision, peak.

    `model` is this rank's GPTModel (anything with `parameters()` and `canonical_shapes()`); `blend` describes
    each source of the data (batches.describe_blend)."""
    run_dir, o = Path(cfg.logging.run_dir), cfg.optimizer
    rows = {
        "model": _size_line(model, cfg),
        "shape": _shape_line(cfg),
        "layout": _layout_line(cfg, world_size),
        **pipeline_rows(cfg, world_size, cfg.gradient_accumulation_steps(world_size)),
        **buffer_row(cfg, cfg.gradient_accumulation_steps(world_size)),
        **moe_rows(cfg, world_size),
        "batch": _batch_line(cfg, world_size),
        "tokens": _tokens_line(cfg),
        "optimizer": f"AdamW lr {o.lr:g} -> {o.min_lr:g}, {cfg.schedule.warmup_steps} warm-up steps then "
                     f"{cfg.schedule.decay}, weight decay {o.weight_decay:g}, clip {o.grad_clip:g}",
        "data": _data_line(cfg),
        **({"blend": blend} if blend else {}),
        "run dir": f"{run_dir} (metrics.jsonl, loss.png{', tensorboard/ if installed' if cfg.logging.tensorboard else ''})",
        "checkpoints": f"{run_dir / 'checkpoints'} every {cfg.checkpoint.interval} steps, keep "
                       f"{cfg.checkpoint.keep_last}, resume {cfg.checkpoint.resume}",
        "precision": Precision(cfg.training.dtype, torch.device(device)).describe(),
        "peak": _peak_line(cfg, torch.device(device)),
    }
    return "\n".join(["run summary", *(f"  {name:<12} {text}" for name, text in rows.items())])
