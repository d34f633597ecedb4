"""The training step and the evaluation at every layout: the schedule's actions on this rank's stage
(`pipeline.runner`), each micro-batch through the one contract (`pipeline.micro_batch_step`). pp = 1 is a pipeline of one
stage: 1f1b runs F0 B0 F1 B1 ..., the loop of one process, and nothing is sent.

    forward/backward  the schedule's actions; each micro-batch's forward and backward inside its dropout
                      coordinates, the forward under autocast, the loss divided by the micro-batches and scaled
                      by the fp16 scaler before its backward
    data parallel     inside the schedule: DDP's no_sync but for the last micro-batch (pp = 1), each chunk's
                      buckets during its last backward (`ChunkReducer`, pp > 1), FSDP2's reduce-scatter
    loss              the last stage's, summed over the pipeline group: every stage logs the same number
    tied embeddings   the first stage's table and the last stage's copy sum their gradients (embedding group)
    gradient norm     summed over tp and pp (`global_grad_norm`), the tied copy counted once: every stage clips
                      and judges divergence on the same number

Batches: every rank reads the step's global batch (a pure function of seed and step) and takes its data-parallel
share, so no stage sends tokens, labels or document ids: only activations and their gradients travel.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..pipeline.after_schedule import losses_on_every_stage, sum_tied_embedding_grads
from ..pipeline.layout import StageCosts, rank_stage
from ..pipeline.runner import PipelineRunner
from ..pipeline.schedules import DEFAULT_SCHEDULE, EVALUATION
from ..pipeline.step_record import StepRecord, measured_bubble
from ..tensor_parallel import parallel_state as ps
from ..tensor_parallel.collectives import all_reduce
from ..transformer.model import GPTModel
from ..transformer.pipeline_stage import PipelineStage
from ..pipeline.micro_batch_step import MicroBatchStep
from .micro_batches import first_sample, on_device
from .precision import fp8_policy


def model_stage(cfg) -> PipelineStage:
    """What this rank builds: the whole model, or its pipeline stage's chunks."""
    par = cfg.parallel
    if par.pipeline_parallel_size == 1:
        return PipelineStage()
    return rank_stage(cfg.model.num_layers, par.pipeline_parallel_size, par.virtual_pipeline_stages,
                      par.pipeline_layers, ps.get_pipeline_parallel_rank(), StageCosts.of(cfg.model, cfg.data.seq_len))


def hidden_shape(cfg, model: GPTModel, rows: int) -> tuple[int, int, int]:
    """[s, b, h] of the activation one stage sends the next for micro-batches of `rows` sequences: this rank's
    part of the sequence."""
    s = cfg.data.seq_len // model.context.cp // (model.tp_size if model.sequence_parallel else 1)
    return s, rows, cfg.model.hidden_size


def build_runners(cfg, model: GPTModel, micro_batches: int, val_batches: list) -> tuple[PipelineRunner, PipelineRunner]:
    """(training runner, evaluation runner: the forward-only schedule), their activation shapes agreed by every
    stage. The validation batches are this data-parallel rank's share of the validation windows, (source,
    micro-batch) pairs whose rows may differ (a blend splits them per source): each gets its own shape."""
    par = cfg.parallel
    groups = ps.get_pipeline_parallel_group(), ps.get_pipeline_links()
    # one stage runs 1f1b whatever the setting: each forward's backward follows it, as DDP's reducer expects
    schedule = par.pipeline_schedule if par.pipeline_parallel_size > 1 else DEFAULT_SCHEDULE
    runner = PipelineRunner(model, schedule, micro_batches, *groups, par.virtual_pipeline_stages)
    evaluation = PipelineRunner(model, EVALUATION.name, len(val_batches), *groups, par.virtual_pipeline_stages)
    dtype = next(model.parameters()).dtype  # the residual stream stays in the parameters' dtype under autocast
    runner.agree_shapes(hidden_shape(cfg, model, cfg.training.micro_batch_size), dtype)
    evaluation.agree_shapes([hidden_shape(cfg, model, batch[0].shape[0]) for _, batch in val_batches], dtype)
    return runner, evaluation


def forward_backward(run, micro_batches: list) -> tuple[torch.Tensor, StepRecord]:
    """The step's schedule on this stage: (the step's loss, the mean of its micro-batches' losses, the same on
    every stage; the stage's record). Leaves complete gradients (dp-averaged, tied summed)."""
    t = run.cfg.training
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    first_rows = [first_sample(t, dp_rank, dp_size, i) for i in range(len(micro_batches))]
    work = MicroBatchStep(run.data_parallel_model, micro_batches, first_rows, t.seed, run.step,
                          run.precision.autocast, run.scaler.scale_loss, run.gradient_sync)
    with fp8_policy(t, run.device, run.fp8_weights):  # training.fp8: the linears, recompute, deferred dW included
        record = run.runner.run(work)
    run.gradient_sync.finish()
    losses = losses_on_every_stage(record, ps.get_pipeline_parallel_group())
    sum_tied_embedding_grads(run.model, ps.get_embedding_group())
    write_timeline(run, record)
    return losses.sum() / len(micro_batches), record


@torch.no_grad()
def validation_losses(run) -> torch.Tensor:
    """Each of this data-parallel rank's validation micro-batches' mean loss (float64), on every stage."""
    batches = on_device([batch for _, batch in run.val_batches], run.cfg.model.vocab_size, run.device)
    work = MicroBatchStep(run.model, batches, autocast=run.precision.autocast)
    with fp8_policy(run.cfg.training, run.device, run.fp8_weights):
        record = run.eval_runner.run(work)
    return losses_on_every_stage(record, ps.get_pipeline_parallel_group()).double()


def pipeline_metrics(run, record: StepRecord) -> dict:
    """{"pipeline_bubble": the measured share of the step the stages spent waiting} at pp > 1, else {}."""
    group = ps.get_pipeline_parallel_group()
    if ps.group_size(group) == 1:
        return {}
    compute = all_reduce(torch.tensor([record.compute_seconds()], dtype=torch.float64, device=run.device), group)
    span = all_reduce(torch.tensor([record.span_seconds()], dtype=torch.float64, device=run.device), group,
                      torch.distributed.ReduceOp.MAX)
    return {"pipeline_bubble": round(measured_bubble(compute.item(), span.item(), ps.group_size(group)), 4)}


def write_timeline(run, record: StepRecord) -> None:
    """At pp > 1, each stage's first rank (dp, cp and tp rank 0) appends the step's events to
    RUN/pipeline_timeline/stage<s>.jsonl on logged steps: what scripts/pipeline_timeline.py draws."""
    step = run.step + 1  # the step being trained
    if ps.group_size(ps.get_pipeline_parallel_group()) == 1 or (step % run.cfg.logging.log_interval != 0 and step != 1):
        return
    if ps.get_data_parallel_rank() or ps.get_context_parallel_rank() or ps.get_tensor_model_parallel_rank():
        return
    folder = Path(run.cfg.logging.run_dir) / "pipeline_timeline"
    folder.mkdir(parents=True, exist_ok=True)
    stage = ps.get_pipeline_parallel_rank()
    with open(folder / f"stage{stage}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "stage": stage, **record.timeline()}) + "\n")
