"""The trainer's step and evaluation when the model is cut into pipeline stages (parallel.pipeline_parallel_size > 1).

    forward/backward  the schedule's actions on this stage (`pipeline.runner`); each micro-batch's forward and
                      backward inside its dropout coordinates, the forward under autocast; the last stage's loss
                      divided by the micro-batches before its backward (as at pp = 1), scaled by the fp16 scaler
    loss              the last stage's sum, all-reduced over the pipeline group: every stage logs the same number
    tied embeddings   the first stage's table and the last stage's copy sum their gradients (embedding group)
    data parallel     the average over dp x cp after the schedule, in flat buckets (DDP's hooks assume one
                      forward per backward, and the weight gradients of zero bubble run outside autograd);
                      under FSDP2 (zero_stage 3) its own reduce-scatter in each backward
    gradient norm     summed over tp and pp (`global_grad_norm`), the tied copy counted once: every stage clips
                      and judges divergence on the same number

Batches: every rank reads the step's global batch (a pure function of seed and step) and takes its data-parallel
share, so no stage sends tokens, labels or document ids: only activations and their gradients travel.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from ..pipeline.layout import rank_stage
from ..pipeline.runner import PipelineRunner, StepRecord, measured_bubble
from ..tensor_parallel import parallel_state as ps
from ..tensor_parallel.collectives import all_reduce
from ..tensor_parallel.param_kinds import local_shard
from ..tensor_parallel.rng import dropout_coordinates
from ..transformer.model import GPTModel
from ..transformer.pipeline_stage import PipelineStage
from .gradients import all_reduce_data_parallel
from .micro_batches import first_sample, model_inputs


def model_stage(cfg) -> PipelineStage:
    """What this rank builds: the whole model, or its pipeline stage's chunks."""
    par = cfg.parallel
    if par.pipeline_parallel_size == 1:
        return PipelineStage()
    return rank_stage(cfg.model.num_layers, par.pipeline_parallel_size, par.virtual_pipeline_stages,
                      par.pipeline_layers, ps.get_pipeline_parallel_rank())


def hidden_shape(cfg, model: GPTModel, rows: int) -> tuple[int, int, int]:
    """[s, b, h] of the activation one stage sends the next for micro-batches of `rows` sequences: this rank's
    part of the sequence."""
    s = cfg.data.seq_len // model.context.cp // (model.tp_size if model.sequence_parallel else 1)
    return s, rows, cfg.model.hidden_size


def build_runners(cfg, model: GPTModel, micro_batches: int, val_batches: list):
    """(training runner, evaluation runner), their activation shapes agreed by every stage; (None, None) at pp 1.
    The validation batches are this data-parallel rank's share of the validation windows (their own size)."""
    par = cfg.parallel
    if par.pipeline_parallel_size == 1:
        return None, None
    rows = {batch[0].shape[0] for _, batch in val_batches}  # (source, micro-batch) pairs
    if len(rows) != 1:
        raise ValueError(f"the validation batches have {sorted(rows)} rows: a pipeline needs them equal (set "
                         "training.eval_batches to a multiple of the data-parallel size).")
    groups = ps.get_pipeline_parallel_group(), ps.get_pipeline_links()
    runners = (PipelineRunner(model, par.pipeline_schedule, micro_batches, *groups, par.virtual_pipeline_stages),
               PipelineRunner(model, "forward_only", len(val_batches), *groups, par.virtual_pipeline_stages))
    dtype = next(model.parameters()).dtype  # the residual stream stays in the parameters' dtype under autocast
    for runner, b in zip(runners, (cfg.training.micro_batch_size, rows.pop())):
        runner.agree_shapes(hidden_shape(cfg, model, b), dtype)
    return runners


def _all_stages(record: StepRecord) -> torch.Tensor:
    """Each micro-batch's loss on every stage (the last stage's, summed with the others' zeros)."""
    return all_reduce(record.losses, ps.get_pipeline_parallel_group())


def pipeline_forward_backward(run, micro_batches: list) -> torch.Tensor:
    """The step's schedule on this stage; returns the step's loss (the mean of the micro-batches' losses, as the
    sum of loss / m at pp 1), the same on every stage. Leaves complete gradients (dp-averaged, tied summed)."""
    t, device = run.cfg.training, run.device
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    def coordinates(i: int):
        return dropout_coordinates(t.seed, run.step, first_sample(t, dp_rank, dp_size, i))

    @contextlib.contextmanager
    def forward_context(i: int):
        with coordinates(i), run.precision.autocast():
            yield

    record = run.pipeline.run(lambda i: model_inputs(micro_batches[i], device), forward_context, coordinates,
                              lambda loss: run.scaler.scale_loss(loss).backward())
    run.pipeline_record = record
    write_timeline(run, record)
    losses = _all_stages(record)
    sum_tied_embedding_grads(run.model)
    if run.cfg.parallel.zero_stage != 3:  # FSDP2 reduce-scattered in each backward
        all_reduce_data_parallel([p for p in run.model.parameters() if p.grad is not None],
                                 ps.get_data_context_parallel_group())
    return losses.sum() / len(micro_batches)


@torch.no_grad()
def pipeline_validation_losses(run) -> torch.Tensor:
    """Each of this data-parallel rank's validation micro-batches' mean loss (float64), on every stage."""
    record = run.pipeline_eval.run(lambda i: model_inputs(run.val_batches[i][1], run.device),
                                   lambda i: run.precision.autocast(), lambda i: contextlib.nullcontext())
    return _all_stages(record).double()


@torch.no_grad()
def sum_tied_embedding_grads(model: GPTModel) -> None:
    """The first stage's embedding table and the last stage's copy: each gets the sum of both gradients, so that
    the two stay equal after the optimizer's step (initialised equal, seeded alike)."""
    group = ps.get_embedding_group()
    holds_tied = model.config.tie_embeddings and model.embed_tokens is not None
    if group is None or not holds_tied:
        return
    weight = model.embed_tokens.weight
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    all_reduce(local_shard(weight.grad).tensor, group)  # FSDP2: both stages hold the same data-parallel shard


def pipeline_metrics(run) -> dict:
    """{"pipeline_bubble": the measured share of the step the stages spent waiting} at pp > 1, else {}."""
    if run.pipeline_record is None:
        return {}
    group, record = ps.get_pipeline_parallel_group(), run.pipeline_record
    compute = all_reduce(torch.tensor([record.compute_seconds()], dtype=torch.float64, device=run.device), group)
    span = all_reduce(torch.tensor([record.span_seconds()], dtype=torch.float64, device=run.device), group,
                       torch.distributed.ReduceOp.MAX)
    return {"pipeline_bubble": round(measured_bubble(compute.item(), span.item(), ps.group_size(group)), 4)}


def write_timeline(run, record: StepRecord) -> None:
    """Each stage's first rank (dp, cp and tp rank 0) appends the step's events to
    RUN/pipeline_timeline/stage<s>.jsonl on logged steps: what scripts/pipeline_timeline.py draws."""
    step = run.step + 1  # the step being trained
    if step % run.cfg.logging.log_interval != 0 and step != 1:
        return
    if ps.get_data_parallel_rank() or ps.get_context_parallel_rank() or ps.get_tensor_model_parallel_rank():
        return
    folder = Path(run.cfg.logging.run_dir) / "pipeline_timeline"
    folder.mkdir(parents=True, exist_ok=True)
    stage = ps.get_pipeline_parallel_rank()
    with open(folder / f"stage{stage}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "stage": stage, **record.timeline()}) + "\n")
