"""parallel.pipeline_* against the model and the batch, before any process group exists: every layer is built
exactly once, the schedule has enough micro-batches, and the features a schedule cannot carry are refused by
name with the fix."""

from __future__ import annotations

from typing import Any

from ...pipeline.layout import stage_layer_counts
from ...pipeline.schedules import DEFAULT_SCHEDULE, SCHEDULES, schedule as registered


def check_pipeline(cfg: Any, micro_batches: int) -> None:
    """`micro_batches`: the step's micro-batches per data-parallel rank (the pipeline's m)."""
    par = cfg.parallel
    pp, v, schedule = par.pipeline_parallel_size, par.virtual_pipeline_stages, par.pipeline_schedule
    chunked = [s.name for s in SCHEDULES.values() if s.chunked]
    if v > 1 and not registered(schedule).chunked:
        raise ValueError(f"parallel.virtual_pipeline_stages={v} needs parallel.pipeline_schedule="
                         f"{' or '.join(chunked)} (got {schedule}): set the schedule, or virtual_pipeline_stages=1.")
    if pp == 1:
        if par.pipeline_layers is not None:
            raise ValueError(f"parallel.pipeline_layers={par.pipeline_layers} is set but pipeline_parallel_size=1: "
                             "remove it, or set parallel.pipeline_parallel_size.")
        return
    stage_layer_counts(cfg.model.num_layers, pp, v, par.pipeline_layers)  # every layer exactly once, >= 1 each
    if micro_batches < pp:
        raise ValueError(
            f"parallel.pipeline_parallel_size={pp} needs at least {pp} micro-batches per step, and "
            f"training.global_batch_size={cfg.training.global_batch_size} / (data-parallel size x micro_batch_size="
            f"{cfg.training.micro_batch_size}) gives {micro_batches}: raise the global batch or lower the "
            f"micro-batch size (m >= 4 pp keeps the bubble (pp-1)/(m+pp-1) under 20 %).")
    if registered(schedule).chunked and (v < 2 or micro_batches % pp != 0):
        raise ValueError(
            f"parallel.pipeline_schedule={schedule} needs virtual_pipeline_stages >= 2 (got {v}) and the "
            f"micro-batches per step ({micro_batches}) a multiple of pipeline_parallel_size={pp}: adjust "
            "virtual_pipeline_stages or training.global_batch_size / micro_batch_size.")
    if par.zero_stage == 3 and registered(schedule).defers_weight_grads:
        raise ValueError(
            f"parallel.pipeline_schedule={schedule} with zero_stage=3: FSDP2 reduce-scatters a layer's gradients "
            f"when its backward ends, before {schedule}'s deferred weight gradients exist. Use zero_stage 1, or "
            f"another schedule ({DEFAULT_SCHEDULE}) with zero_stage 3.")
