"""The pretraining loop: tensor parallelism p x data parallelism world/p, from a PretrainConfig.

One step: the global batch of `step` (a pure function of seed and step) split over the
data-parallel ranks and into micro-batches; forward/backward per micro-batch; finalize_grads
(tensor-parallel partial gradients); data-parallel gradient average; global norm, clipping,
AdamW. Checkpoints every `checkpoint.interval` steps, at the end and on SIGTERM; resume is exact.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .. import parallel_state as ps
from ..checkpoint import CheckpointCorruptError, CheckpointError, latest_checkpoint, load_checkpoint, load_latest_valid, save_checkpoint
from ..checkpoint_manifest import read_manifest
from ..config import PretrainConfig, save_config
from ..grads import finalize_grads
from ..model import GPTModel
from ..parallel_state import init_distributed
from ..random import manual_seed
from ..reshard import load_resharded
from .data import GlobalBatchSampler, TokenDataset, ensure_prepared, validation_batches
from .gradients import all_reduce_data_parallel, clip_gradients, global_grad_norm
from .loss_scaler import DynamicLossScaler
from .metrics import MetricsLogger, plot_loss
from .optim import build_optimizer, learning_rate, set_learning_rate


@dataclass
class TrainResult:
    run_dir: Path
    last_step: int
    losses: dict[int, float]
    val_losses: dict[int, float]
    stopped_by_signal: bool


class _SigtermFlag:
    """Turns SIGTERM into a flag checked between steps, so the run can checkpoint and exit cleanly."""

    def __init__(self) -> None:
        self.raised = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.raised = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def _any_rank(flag: bool, device) -> bool:
    """True on every rank if any rank says True (SIGTERM may reach ranks at different steps)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _mean_over(value: torch.Tensor, group) -> float:
    if ps.group_size(group) > 1:
        dist.all_reduce(value, group=group)
        value = value / ps.group_size(group)
    return value.item()


def _autocast(cfg: PretrainConfig, device: torch.device):
    if device.type != "cuda" or cfg.training.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=getattr(torch, cfg.training.dtype))


def build_data(cfg: PretrainConfig, device: torch.device) -> tuple[GlobalBatchSampler, TokenDataset]:
    if dist.get_rank() == 0:
        ensure_prepared(cfg.data)
    dist.barrier()
    train = TokenDataset(cfg.data.data_dir, "train")
    if train.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the data's tokenizer has {train.vocab_size} tokens but model.vocab_size="
                         f"{cfg.model.vocab_size}: set model.vocab_size >= {train.vocab_size}.")
    return GlobalBatchSampler(train, cfg.data.seq_len, cfg.training.global_batch_size, cfg.training.seed), \
        TokenDataset(cfg.data.data_dir, "val")


@torch.no_grad()
def evaluate(model: GPTModel, batches, cfg: PretrainConfig, device) -> float:
    model.eval()
    total = torch.zeros((), device=device)
    for tokens, labels in batches:
        with _autocast(cfg, device):
            total += model(tokens.to(device), labels.to(device)).float()
    model.train()
    return _mean_over(total / len(batches), ps.get_data_parallel_group())


def _resume(cfg: PretrainConfig, resume: str, ckpt_root: Path, model, optimizer, tp_group, dp_group, world: int):
    """Load the checkpoint to continue from: exactly at the same layout, resharded at another one."""
    target = latest_checkpoint(ckpt_root) if resume == "auto" else Path(resume)
    if target is None:
        return None
    model_cfg = {k: v for k, v in cfg.to_dict()["model"].items() if k not in _MODEL_KEYS_FREE_TO_CHANGE}
    common = dict(expected_config={"model": model_cfg}, tp_group=tp_group, dp_group=dp_group)
    try:
        saved = read_manifest(target)
    except CheckpointCorruptError:
        if resume != "auto":
            raise
        return load_latest_valid(ckpt_root, model, optimizer, **common)  # falls back past it
    differs = {k: (saved["config"]["model"].get(k), v) for k, v in model_cfg.items()
               if saved["config"]["model"].get(k) != v}
    if differs:
        raise CheckpointError(f"{target} holds another model: " + "; ".join(
            f"model.{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in differs.items()))
    same_layout = (saved["tensor_parallel_size"], saved["world_size"]) == (cfg.parallel.tensor_parallel_size, world)
    if same_layout and not saved.get("resharded"):
        return (load_latest_valid(ckpt_root, model, optimizer, **common) if resume == "auto"
                else load_checkpoint(target, model, optimizer, **common))
    manifest = load_resharded(target, model, optimizer, tp_group=tp_group)
    manual_seed(cfg.training.seed + manifest["step"])  # per-rank RNG states do not carry across layouts
    return manifest


# settings that change how the model runs, not what its weights are
_MODEL_KEYS_FREE_TO_CHANGE = {"hidden_dropout", "attention_dropout", "recompute_activations", "attention_backend"}


def train(cfg: PretrainConfig, resume: str | None = None) -> TrainResult:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.validate(world)  # before any process group exists
    backend = None if cfg.parallel.backend == "auto" else cfg.parallel.backend
    device = init_distributed(cfg.parallel.tensor_parallel_size, backend=backend, timeout=cfg.parallel.timeout_s)
    run_dir, rank = Path(cfg.logging.run_dir), dist.get_rank()
    ckpt_root = run_dir / "checkpoints"
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    sampler, val_data = build_data(cfg, device)
    tp_group, dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    manual_seed(cfg.training.seed)
    model = GPTModel(cfg.model, cfg.parallel.sequence_parallel, device=device)
    optimizer = build_optimizer(model, cfg.optimizer)
    scaler = DynamicLossScaler(enabled=device.type == "cuda" and cfg.training.dtype == "float16")
    val_batches = validation_batches(val_data, cfg.data.seq_len, cfg.training.micro_batch_size * dp_size,
                                     cfg.training.eval_batches, dp_rank=dp_rank, dp_size=dp_size)

    start_step = 0
    resume = resume or cfg.checkpoint.resume
    if resume != "none":
        manifest = _resume(cfg, resume, ckpt_root, model, optimizer, tp_group, dp_group, world)
        if manifest is not None:
            start_step = manifest["step"]
            if "loss_scaler" in manifest["extra"]:
                scaler.load_state_dict(manifest["extra"]["loss_scaler"])
            if rank == 0:
                print(f"resumed from {manifest['path']} at step {start_step}", file=sys.stderr, flush=True)

    logger = MetricsLogger(run_dir, cfg.training.max_steps, start_step, cfg.logging.progress_bar,
                           cfg.logging.tensorboard) if rank == 0 else None
    sigterm = _SigtermFlag()
    losses, val_losses = {}, {}
    tokens_per_step = cfg.training.global_batch_size * cfg.data.seq_len
    step, stopped = start_step, False

    def checkpoint(at_step: int) -> None:
        save_checkpoint(ckpt_root, at_step, model, optimizer, config=cfg.to_dict(),
                        extra={"loss_scaler": scaler.state_dict(), "tokens_seen": at_step * tokens_per_step},
                        keep_last=cfg.checkpoint.keep_last, tp_group=tp_group, dp_group=dp_group)

    try:
        if start_step == 0:  # the starting point the validation curve falls from
            val_losses[0] = evaluate(model, val_batches, cfg, device)
            if logger is not None:
                logger.log({"step": 0, "val_loss": val_losses[0]})
        while step < cfg.training.max_steps:
            started = time.perf_counter()
            lr = learning_rate(step, cfg.training.max_steps, cfg.optimizer, cfg.schedule)
            set_learning_rate(optimizer, lr)
            optimizer.zero_grad(set_to_none=True)
            micro_batches = sampler.local_micro_batches(step, dp_rank, dp_size, cfg.training.micro_batch_size)
            loss_sum = torch.zeros((), device=device)
            for tokens, labels in micro_batches:
                with _autocast(cfg, device):
                    loss = model(tokens.to(device), labels.to(device)) / len(micro_batches)
                scaler.scale_loss(loss).backward()
                loss_sum += loss.detach().float()
            finalize_grads(model)
            all_reduce_data_parallel(list(model.parameters()), dp_group)
            scaler.unscale(model.parameters())
            grad_norm = global_grad_norm(model, tp_group)
            if scaler.update(grad_norm.item()):
                clip_gradients(model, cfg.optimizer.grad_clip, grad_norm)
                optimizer.step()
            step += 1
            losses[step] = _mean_over(loss_sum, dp_group)
            record = {"step": step, "loss": losses[step], "lr": lr, "grad_norm": grad_norm.item(),
                      "tokens_per_s": tokens_per_step / (time.perf_counter() - started)}
            if step % cfg.training.eval_interval == 0 or step == cfg.training.max_steps:
                val_losses[step] = record["val_loss"] = evaluate(model, val_batches, cfg, device)
            if logger is not None and (step % cfg.logging.log_interval == 0 or "val_loss" in record
                                       or step == start_step + 1):
                logger.log(record)
            stopped = _any_rank(sigterm.raised, device)
            if stopped or step % cfg.checkpoint.interval == 0 or step == cfg.training.max_steps:
                checkpoint(step)
            if stopped:
                break
    finally:
        sigterm.restore()
        if logger is not None:
            logger.close()
    if rank == 0 and (run_dir / "metrics.jsonl").exists():
        plot_loss(run_dir)
    return TrainResult(run_dir, step, losses, val_losses, stopped)
