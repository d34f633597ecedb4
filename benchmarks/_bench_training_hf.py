"""The Hugging Face transformers baseline of benchmarks/benchmark_training.py, on our model's own weights.

Our initial weights are exported with parallel_attention.hf (LlamaForCausalLM for a Llama-style config,
GPT2LMHeadModel for a GPT-2-style one) and loaded by transformers: in this single process at p = 1, with
`tp_plan="auto"` (transformers' own tensor parallelism over every launched rank) at p > 1. Before anything
is timed, both models' losses on the first micro-batch must agree within 1e-5 (float32), else the baseline
is skipped with the difference as its reason. Its training step mirrors ours: the same micro-batches, forward,
cross entropy, backward, global-norm clipping and AdamW with the same hyperparameters (fused, as ours and as
transformers' Trainer on torch >= 2.8).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from parallel_attention.hf import canonical_to_hf
from parallel_attention.hf.config import infer_architecture
from parallel_attention.tensor_parallel import parallel_state as ps
from parallel_attention.tensor_parallel.collectives import all_gather_objects, barrier

LOSS_TOLERANCE = 1e-5  # float32, same weights and tokens: only summation order differs


class Skipped(Exception):
    """The baseline cannot run here; the message says why."""


def _loss(hf_model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of the next-token `labels` [b, s] (already shifted, -100 ignored), as ours: the model's
    own `.loss` (what transformers' Trainer reads), `shift_labels` saying they need no shift."""
    return hf_model(input_ids=tokens, labels=labels, shift_labels=labels).loss


def export_weights(run, workdir: Path) -> tuple[Path, str]:
    """Our initial weights as a transformers directory, rank 0 writing (a collective): (directory, architecture).
    Skipped where transformers is missing, dp > 1 or the config has no transformers counterpart."""
    if importlib.util.find_spec("transformers") is None:
        raise Skipped("transformers is not installed: pip install -e '.[bench]'")
    if ps.get_data_parallel_world_size() > 1:
        raise Skipped("transformers' tp_plan covers every launched rank: run the baseline at data-parallel size 1")
    try:
        architecture = infer_architecture(run.cfg.model)
    except ValueError as error:
        raise Skipped(f"no transformers counterpart: {error}") from None
    hf_dir = workdir / "hf_weights"
    canonical = run.model.canonical_state_dict()  # a collective over the tensor-parallel group
    if ps.get_global_rank() == 0:
        shutil.rmtree(hf_dir, ignore_errors=True)  # a previous benchmark's export
        canonical_to_hf(run.cfg.model, {k: v.cpu() for k, v in canonical.items()}, hf_dir, architecture)
    barrier()
    return hf_dir, architecture


def _load(run, workdir: Path):
    """Export our weights (rank 0 writes), then load them into transformers."""
    from transformers import AutoModelForCausalLM

    hf_dir, architecture = export_weights(run, workdir)
    p = ps.get_tensor_model_parallel_world_size()
    kwargs = {"tp_plan": "auto"} if p > 1 else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                     **kwargs)
    except Exception as error:  # an architecture without a tp_plan, an old transformers: skip, say why
        raise Skipped(f"transformers could not load {architecture}{' with tp_plan=auto' if p > 1 else ''}: "
                      f"{type(error).__name__}: {error}") from None
    return (model if p > 1 else model.to(run.device)), architecture


@torch.no_grad()
def _loss_difference(run, hf_model) -> float:
    """|our loss - transformers' loss| on step 0's first micro-batch, dropout off in both."""
    tokens, labels = run.sampler.local_micro_batches(0, 0, 1, run.cfg.training.micro_batch_size)[0]
    tokens, labels = tokens.to(run.device), labels.to(run.device)
    run.model.eval(), hf_model.eval()
    try:
        ours, theirs = run.model(tokens, labels).item(), _loss(hf_model, tokens, labels).item()
    finally:
        run.model.train(), hf_model.train()
    return abs(ours - theirs)


def transformers_baseline(run, workdir: Path) -> tuple[object | None, dict]:
    """(step function or None, the facts for the JSON). Call on every rank before our first step."""
    try:
        hf_model, architecture = _load(run, workdir)
    except Skipped as why:
        return None, {"status": "skipped", "reason": str(why)}
    difference = max(all_gather_objects(_loss_difference(run, hf_model)))
    info = {"architecture": architecture, "loss_difference": difference,
            "tp_plan": "auto" if ps.get_tensor_model_parallel_world_size() > 1 else None}
    if difference > LOSS_TOLERANCE:
        return None, {**info, "status": "skipped",
                      "reason": f"losses differ by {difference:.2e} (> {LOSS_TOLERANCE:g}) on the same weights"}
    return _step_function(run, hf_model), {**info, "status": "ok"}


@torch.no_grad()
def _clip_by_global_norm(hf_model, max_norm: float) -> None:
    """clip_grad_norm_ for a model whose gradients are partly DTensors (tp_plan shards some parameters and
    leaves the norms plain; torch's clip refuses the mix): one norm per kind, combined."""
    grads = [p.grad for p in hf_model.parameters() if p.grad is not None]
    norms = []
    for kind in (True, False):
        group = [g for g in grads if hasattr(g, "full_tensor") == kind]
        if group:
            norm = torch.nn.utils.get_total_norm(group)
            norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    coefficient = min(1.0, max_norm / (torch.linalg.vector_norm(torch.stack(norms)).item() + 1e-6))
    for g in grads:
        g.mul_(coefficient)


def _step_function(run, hf_model, clip=_clip_by_global_norm):
    """One training step of the transformers model on the micro-batches our step of the same index uses;
    `clip(hf_model, max_norm)` clips where optimizer.grad_clip is set."""
    o, t = run.cfg.optimizer, run.cfg.training
    # fused: what transformers' Trainer picks on torch >= 2.8 (optim="adamw_torch_fused"), and what ours runs;
    # one kernel call per group, and a call may not mix DTensors (tp_plan's shards) with plain tensors
    params = list(hf_model.parameters())
    groups = [{"params": [p for p in params if isinstance(p, DTensor) is sharded]} for sharded in (True, False)]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, fused=True)
    state = {"step": 0}

    def step() -> float:
        micro_batches = run.sampler.local_micro_batches(state["step"], 0, 1, t.micro_batch_size)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for tokens, labels in micro_batches:
            with run.precision.autocast():  # the same precision as ours, on every device
                loss = _loss(hf_model, tokens.to(run.device), labels.to(run.device)) / len(micro_batches)
            loss.backward()
            total += loss.detach()
        if o.grad_clip:
            clip(hf_model, o.grad_clip)
        optimizer.step()
        state["step"] += 1
        return float(total)

    return step
