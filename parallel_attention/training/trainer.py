"""The pretraining loop as a story: build -> resume -> train_loop (train_step, evaluate, log, checkpoint, stop).

One step: the global batch of `step` (a pure function of seed and step) split over the data-parallel ranks and into
micro-batches, read, checked and moved to the device a step ahead; the schedule's forwards and backwards at every
pp (`step`: pp = 1 is one stage, F0 B0 F1 B1 ...), the data-parallel average during the last backward (DDP, a
pipeline's `ChunkReducer`) or FSDP2's reduce-scatter (zero_stage 3); finalize_grads (tensor-parallel partial
gradients); global norm, clipping, AdamW (its state sharded at zero_stage 1), unless the divergence guard skips or
stops the step. After it, in `train_loop`: evaluate, log, stop on divergence, checkpoint (every
`checkpoint.interval` steps, at the end and on SIGTERM or SIGINT; the replicas audited first) or audit, stop.
Resume is exact.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpointing.checkpoint import save_checkpoint
from ..tensor_parallel import parallel_state as ps
from ..launch.rank_zero import is_rank_zero
from ..tensor_parallel.collective_log import enable_collective_log
from ..tensor_parallel.collectives import all_reduce, any_rank
from ..tensor_parallel.fp8_all_gather import Fp8WeightGather
from ..tensor_parallel.param_kinds import finalize_grads
from ..tensor_parallel.rng import manual_seed
from ..pipeline.micro_batch_step import GradientSync, loss_share
from ..pipeline.runner import PipelineRunner
from ..transformer.model import GPTModel
from ..transformer.moe import moe_step, update_expert_bias
from .config.schema import PretrainConfig
from .config.checks import check_resume
from .compile import compile_layers
from .guards.divergence import DivergenceGuard, check_parameters_finite
from .flops import agree_peak_tflops, step_rates
from .guards.rank_checks import check_config_agreement, check_replicas
from .data.read.batch_prefetch import BatchPrefetcher
from .data.read.batches import GlobalBatchSampler, describe_blend
from .data.read.run_data import build_data
from .data.read.validation import run_validation
from .data.read.data_identity import check_identity, keep_run_tokenizer, run_data_identity
from .data_parallel import data_parallel_step
from .gradients import clip_gradients, global_grad_norm
from .loss_scaler import DynamicLossScaler
from .metrics import MetricsLogger, plot_loss
from .evaluation import evaluate
from .micro_batches import on_device
from .optim import build_optimizer, learning_rate, set_learning_rate
from .step import build_runners, forward_backward, model_stage, pipeline_metrics
from .precision import Precision, fp8_weight_gather
from .run.resume import keep_previous_sampling, resume_from_checkpoint
from .run.run_start import say_start
from .run.run_dir import ensure_run_dir_held, lock_run_dir, prepare_run_dir, release_run_dir, write_run_config
from .run.stop_signals import StopSignals
from .run.summary import run_summary


@dataclass
class TrainResult:
    run_dir: Path
    last_step: int
    losses: dict[int, float]
    val_losses: dict[int, float]
    stopped_by_signal: str | None  # the signal's name (SIGTERM, SIGINT) when one stopped the run


@dataclass
class Run:
    """What a run holds between steps."""

    cfg: PretrainConfig
    device: torch.device
    model: GPTModel  # the raw model: checkpoints, norms, audit and evaluation read it
    optimizer: torch.optim.Optimizer
    scaler: DynamicLossScaler
    precision: Precision  # decided once: each forward's autocast context, whether the scaler is on
    sampler: GlobalBatchSampler
    val_batches: list
    loader: BatchPrefetcher | None = None  # this rank's micro-batches of each step, read a step ahead
    data_identity: dict | None = None  # the tokenizer and data it trains on (data/read/data_identity.py): in every checkpoint
    runner: PipelineRunner | None = None  # this stage's schedule (pp = 1: one stage), and evaluation's
    eval_runner: PipelineRunner | None = None
    data_parallel_model: torch.nn.Module | None = None  # the training forward: DDP over the dp group, or `model`
    gradient_sync: GradientSync = field(default_factory=GradientSync)  # how the data-parallel average runs
    fp8_weights: Fp8WeightGather | None = None  # zero_stage 3, tensorwise FP8: the weights FSDP2 gathers in e4m3
    step: int = 0
    logger: MetricsLogger | None = None
    losses: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)
    stopped: bool = False
    guard: DivergenceGuard = field(init=False)

    def __post_init__(self) -> None:
        self.guard = DivergenceGuard(self.scaler, self.cfg.training.max_skipped_steps, self.cfg.training.dtype)
        if self.data_parallel_model is None:
            self.data_parallel_model = self.model
        if self.loader is None:
            self.loader = BatchPrefetcher(self._read_step)

    def _read_step(self, step: int) -> list[tuple]:
        """This rank's micro-batches of `step`, checked and on the device (the prefetch thread runs it)."""
        batches = self.sampler.local_micro_batches(step, dp_rank=ps.get_data_parallel_rank(),
                                                   dp_size=ps.get_data_parallel_world_size(),
                                                   micro_batch_size=self.cfg.training.micro_batch_size)
        return on_device(batches, self.cfg.model.vocab_size, self.device)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.logging.run_dir)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.training.global_batch_size * self.cfg.data.seq_len


def build(cfg: PretrainConfig) -> Run:
    """Process groups, run directory, data, model, optimizer: everything before the first step."""
    if cfg.parallel.debug_collectives:  # before the groups exist, so that torch's own checks wrap them too
        enable_collective_log()
    backend = None if cfg.parallel.distributed_backend == "auto" else cfg.parallel.distributed_backend
    device = ps.init_distributed(cfg.parallel.tensor_parallel_size, backend=backend, timeout=cfg.parallel.timeout_s,
                                 context_parallel_size=cfg.parallel.context_parallel_size,
                                 pipeline_model_parallel_size=cfg.parallel.pipeline_parallel_size,
                                 expert_model_parallel_size=cfg.parallel.expert_parallel_size)
    check_config_agreement(cfg)  # before anything is written or drawn: every rank must run this same config
    lock_run_dir(cfg)  # one run per directory: refused before anything is written if another run holds it
    prepare_run_dir(cfg)  # rank 0 makes it and clears a dead run's leftovers; every rank refuses an unwritable one
    sampler, sources = build_data(cfg)
    agree_peak_tflops(cfg.logging.peak_tflops, device)  # every rank measures now, together: MFU's denominator
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    manual_seed(cfg.training.seed)
    model = GPTModel(cfg.model, cfg.parallel.sequence_parallel, tp_group=ps.get_tensor_model_parallel_group(),
                     device=device, overlap_comm=cfg.parallel.overlap_comm,
                     context_parallel_kind=cfg.parallel.context_parallel_kind, stage=model_stage(cfg))
    if cfg.model.compile:
        compile_layers(model)
    val_batches = run_validation(cfg, sources, sampler.weights, dp_rank, dp_size)  # (source, micro-batch) pairs
    precision = Precision(cfg.training.dtype, device)
    scaler = DynamicLossScaler(enabled=precision.loss_scaling)
    # parameters are replicated over dp x cp: their gradients are averaged (and ZeRO-1 shards) over both
    dp_group, zero_stage = ps.get_data_context_parallel_group(), cfg.parallel.zero_stage
    runner, eval_runner = build_runners(cfg, model, cfg.gradient_accumulation_steps(ps.get_world_size()),
                                        val_batches)
    fp8_weights = fp8_weight_gather(model, cfg.training, zero_stage, dp_group)  # FSDP2 gathers them in e4m3
    forward, sync = data_parallel_step(model, dp_group, cfg.parallel.debug_collectives, zero_stage,
                                       pipelined=cfg.parallel.pipeline_parallel_size > 1)
    optimizer = build_optimizer(model, cfg.optimizer, dp_group, zero_stage)  # over FSDP2's shards at stage 3
    return Run(cfg, device, model, optimizer, scaler, precision, sampler, val_batches, runner=runner,
               eval_runner=eval_runner, data_parallel_model=forward, gradient_sync=sync, fp8_weights=fp8_weights)


def resume_run(run: Run, where: str) -> None:
    """Continue from a checkpoint (`auto`, a step directory, or `none`) of this tokenizer and data, then write
    config.yaml and the tokenizer and open the metrics log: a refused resume (exit 2) leaves the run dir as it was."""
    manifest = None if where == "none" else resume_from_checkpoint(run.cfg, where, run.model, run.optimizer)
    run.data_identity = run_data_identity(run.cfg, run.sampler, manifest)  # with the blend's history, continued
    if manifest is not None:
        check_identity(manifest, run.data_identity, run.cfg.checkpoint.allow_data_change)
        run.step = manifest["step"]
        if "loss_scaler" in manifest["extra"]:
            run.scaler.load_state_dict(manifest["extra"]["loss_scaler"])
        run.guard.load_state_dict(manifest["extra"])
    if not say_start(run.cfg, where, manifest):  # nothing to do: no step, and nothing of the run rewritten
        return
    write_run_config(run.cfg)
    if is_rank_zero():
        keep_run_tokenizer(run.cfg, run.sampler.sources)
        log = run.cfg.logging
        run.logger = MetricsLogger(run.run_dir, run.cfg.training.max_steps, run.step, log.progress_bar,
                                   log.tensorboard)


def train_step(run: Run) -> dict:
    """One optimizer step, unless the divergence guard skips it; returns its metrics record."""
    started = time.perf_counter()
    lr = learning_rate(run.step, run.cfg.training.max_steps, run.cfg.optimizer, run.cfg.schedule)
    set_learning_rate(run.optimizer, lr)
    run.optimizer.zero_grad(set_to_none=True)
    micro_batches, data_wait_s = run.loader.get(run.step)
    with moe_step(loss_share(run.scaler.scale_loss, len(micro_batches))) as moe_record:
        loss_sum, record = forward_backward(run, micro_batches)
    finalize_grads(run.model)  # after the data-parallel average of the backward: the two commute
    run.scaler.unscale(run.model.parameters())
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_parallel_group()
    grad_norm = global_grad_norm(run.model, tp_group, pp_group=pp_group, counted_elsewhere=run.model.pipeline_copies())
    dp_group = ps.get_data_parallel_group()
    loss = (all_reduce(loss_sum, dp_group) / ps.group_size(dp_group)).item()  # the mean over data-parallel ranks
    applied = run.guard.update(run.step + 1, loss, grad_norm.item())
    if applied:
        clip_gradients(run.model, run.cfg.optimizer.grad_clip, grad_norm)
        run.optimizer.step()
    update_expert_bias(run.model, applied)  # the balancing biases move with the update, or not at all
    run.step += 1
    run.losses[run.step] = loss
    return {"step": run.step, "loss": loss, "lr": lr, "grad_norm": grad_norm.item(),
            "skipped_steps": run.guard.skipped_steps, "data_wait_s": round(data_wait_s, 6),
            "epochs": run.sampler.epochs(run.step),
            **step_rates(run.cfg, run.device, run.tokens_per_step, time.perf_counter() - started),
            **run.scaler.record(), **pipeline_metrics(run, record),  # fp16: the loss scale after this step
            **moe_record.metrics(run.cfg.model, dp_group, pp_group)}


def checkpoint(run: Run) -> None:
    """Audit the replicas and check the parameters are finite (either raises before anything is written), then
    save; `finite` records whether this step's update was applied (false right after an fp16 overflow)."""
    check_replicas(run.model, run.step)
    check_parameters_finite(run.model, run.step, run.device)
    extra = {"loss_scaler": run.scaler.state_dict(), "tokens_seen": run.step * run.tokens_per_step,
             "data_identity": run.data_identity,
             **run.guard.state_dict(), "finite": run.guard.consecutive == 0}
    save_checkpoint(Path(run.cfg.logging.run_dir) / "checkpoints", run.step, run.model, run.optimizer,
                    config=run.cfg.to_dict(), keep_last=run.cfg.checkpoint.keep_last, extra=extra,
                    tp_group=ps.get_tensor_model_parallel_group(), dp_group=ps.get_data_context_parallel_group())


def log_step(run: Run, record: dict, diverged: bool) -> None:
    """Rank 0: check it still holds the run directory (before it writes this step's outputs), then log the step if
    due (every `logging.log_interval` steps, with a validation loss, the first step, a diverged one)."""
    if run.logger is None:
        return
    ensure_run_dir_held(run.cfg)
    if run.step % run.cfg.logging.log_interval == 0 or "val_loss" in record or run.step == min(run.losses) \
            or diverged:
        run.logger.log(record)


def train_loop(run: Run, stop: StopSignals) -> None:
    """The steps, to `training.max_steps` or until SIGTERM or SIGINT on any rank.

    A diverged step is logged, then raises DivergenceError on every rank; a failed audit raises
    ReplicaMismatchError: both before any checkpoint is written."""
    t = run.cfg.training
    while run.step < t.max_steps and not run.stopped:
        record = train_step(run)
        last, diverged = run.step == t.max_steps, run.guard.stop_reason is not None
        if not diverged and (run.step % t.eval_interval == 0 or last):
            record.update(evaluate(run))
            run.val_losses[run.step] = record["val_loss"]
        log_step(run, record, diverged)
        run.guard.raise_if_stopped()
        run.stopped = any_rank(stop.raised, run.device)  # every rank checkpoints this same step, then stops
        if run.stopped or run.step % run.cfg.checkpoint.interval == 0 or last:
            checkpoint(run)
        elif t.audit_interval and run.step % t.audit_interval == 0:
            check_replicas(run.model, run.step)


def train(cfg: PretrainConfig, resume: str | None = None) -> TrainResult:
    """Validate, build, resume, then train to `training.max_steps` (or until SIGTERM or SIGINT).

    `resume` overrides `checkpoint.resume`. Raises ConfigError (before any process group exists)
    when the config does not fit the launched world."""
    cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))
    if resume is not None:  # --resume overrides checkpoint.resume: the same rule, before any process group
        check_resume(resume, "--resume")
    cfg = keep_previous_sampling(cfg, resume or cfg.checkpoint.resume)  # the sampling the run was started with
    try:
        return _train_built(cfg, build(cfg), resume)
    finally:
        release_run_dir(cfg)


def _train_built(cfg: PretrainConfig, run: Run, resume: str | None) -> TrainResult:
    """Summary, resume, then the steps; the caller releases the run directory on every way out."""
    if is_rank_zero():
        blend = describe_blend(run.sampler, cfg.training.max_steps)
        print(run_summary(cfg, run.model, ps.get_world_size(), run.device, blend), file=sys.stderr, flush=True)
    resume_run(run, resume or cfg.checkpoint.resume)
    stop = StopSignals()
    try:
        if run.step == 0:  # the starting point the validation curve falls from
            run.val_losses[0] = (first := evaluate(run))["val_loss"]
            if run.logger is not None:
                run.logger.log({"step": 0, **first})
        train_loop(run, stop)
    finally:
        stop.restore()
        run.loader.close()
        if run.logger is not None:
            run.logger.close()
    if run.logger is not None and (run.run_dir / "metrics.jsonl").exists():  # rank 0, unless nothing to do
        plot_loss(run.run_dir)
    return TrainResult(run.run_dir, run.step, run.losses, run.val_losses, stop.name() if run.stopped else None)
