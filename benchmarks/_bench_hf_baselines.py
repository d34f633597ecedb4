"""The baselines of benchmarks/benchmark_training.py (`--baseline NAME`, repeatable), all on our model's own
initial weights and timed in the same alternating rounds as ours:

    transformers      transformers' model (LlamaForCausalLM for a Llama-style config, GPT2LMHeadModel for a
                      GPT-2-style one): in one process at p = 1, `tp_plan="auto"` at p > 1 (_bench_training_hf.py)
    transformers_p1   the same model whole in one process, at any p: global rank 0 runs it while the other ranks
                      return at once and wait at the next round's barrier. The round's time is rank 0's (the
                      slowest rank), on a core no other rank computes on: a p = 1 step next to the p > 1 ones
    parallelize       the same model made tensor parallel by `parallel_attention.parallelize` over the
                      tensor-parallel group; clipped (where optimizer.grad_clip is set) with
                      `parallel_attention.clip_grad_norm_`

Before anything is timed each must give our loss on the first micro-batch within 1e-5 (float32), else it is
skipped with the difference as its reason. Each step is _bench_training_hf's: the same micro-batches, forward
and transformers' own `.loss` (labels given, `shift_labels`: already shifted), backward, (clipping,) fused AdamW
with our hyperparameters.
Ratios are reported as the ratio of medians and as the median of per-round ratios (paired: the host's drift
between rounds cancels).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from _bench_training_hf import LOSS_TOLERANCE, Skipped, _loss, _step_function, export_weights, transformers_baseline
from _bench_training_timing import summary_ms
from parallel_attention.tensor_parallel import parallel_state as ps
from parallel_attention.tensor_parallel.collectives import all_gather_objects

BASELINES = ("transformers", "transformers_p1", "parallelize")
# (numerator, denominator): the step ratios the report gives where both ran (issue 24's speed targets)
RATIOS = (("parallelize", "transformers"), ("parallelize", "transformers_p1"))


def _from_pretrained(hf_dir: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    except Exception as error:  # an old transformers, an architecture it lacks: skip, say why
        raise Skipped(f"transformers could not load {hf_dir}: {type(error).__name__}: {error}") from None
    return model.to(device)


@torch.no_grad()
def _loss_difference(run, hf_model) -> float:
    """|our loss - the model's| on step 0's first micro-batch, dropout off; 0 on a rank without the model
    (our forward is a collective: every rank runs it)."""
    tokens, labels = run.sampler.local_micro_batches(0, 0, 1, run.cfg.training.micro_batch_size)[0]
    tokens, labels = tokens.to(run.device), labels.to(run.device)
    models = [m for m in (run.model, hf_model) if m is not None]
    for m in models:
        m.eval()
    try:
        ours = run.model(tokens, labels).item()
        return abs(ours - _loss(hf_model, tokens, labels).item()) if hf_model is not None else 0.0
    finally:
        for m in models:
            m.train()


def _checked(run, hf_model, info: dict, step):
    """(step or None, info): the step only where every rank's loss agrees with ours."""
    difference = max(all_gather_objects(_loss_difference(run, hf_model)))
    info = {**info, "loss_difference": difference}
    if difference > LOSS_TOLERANCE:
        return None, {**info, "status": "skipped",
                      "reason": f"losses differ by {difference:.2e} (> {LOSS_TOLERANCE:g}) on the same weights"}
    return step, {**info, "status": "ok"}


def _idle() -> float:
    return 0.0


def single_process_baseline(run, workdir: Path) -> tuple[object | None, dict]:
    """transformers whole on global rank 0, the other ranks idle (see the module docstring)."""
    try:
        hf_dir, architecture = export_weights(run, workdir)
        # every rank tries (a rank alone in the loop would leave the others waiting), rank 0 keeps it
        model = _from_pretrained(hf_dir, run.device) if ps.get_global_rank() == 0 else None
    except Skipped as why:
        return None, {"status": "skipped", "reason": str(why)}
    step = _step_function(run, model) if model is not None else _idle
    return _checked(run, model, {"architecture": architecture, "processes": 1}, step)


def parallelize_baseline(run, workdir: Path) -> tuple[object | None, dict]:
    """transformers' model made tensor parallel by parallel_attention.parallelize."""
    try:
        from parallel_attention import clip_grad_norm_, parallelize
    except ImportError as error:
        return None, {"status": "skipped", "reason": f"parallel_attention.parallelize is missing: {error}"}
    try:
        hf_dir, architecture = export_weights(run, workdir)
        model = _from_pretrained(hf_dir, run.device)
    except Skipped as why:
        return None, {"status": "skipped", "reason": str(why)}
    try:
        parallelize(model, tp_group=ps.get_tensor_model_parallel_group())
    except ValueError as error:  # a family or a feature parallelize refuses: say which
        return None, {"architecture": architecture, "status": "skipped", "reason": f"parallelize refused: {error}"}
    step = _step_function(run, model, clip=lambda m, max_norm: clip_grad_norm_(m, max_norm))
    return _checked(run, model, {"architecture": architecture,
                                 "tensor_parallel_size": ps.get_tensor_model_parallel_world_size()}, step)


BUILDERS = {"transformers": transformers_baseline, "transformers_p1": single_process_baseline,
            "parallelize": parallelize_baseline}


def hf_baselines(run, workdir: Path, names) -> tuple[dict, dict]:
    """(name -> step, name -> the facts for the JSON) of each chosen baseline; a skipped one has no step. Call on
    every rank before our first step (the same initial weights)."""
    steps, infos = {}, {}
    for name in dict.fromkeys(names):
        step, infos[name] = BUILDERS[name](run, workdir)
        if step is not None:
            steps[name] = step
    return steps, infos


def _ratios(times: dict, a: str, b: str) -> dict:
    return {"of_medians": statistics.median(times[a]) / statistics.median(times[b]),
            "paired": statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))}


def baselines_report(times: dict, infos: dict) -> dict:
    """Each baseline's facts with its step_ms and ours / it (where it ran), and the RATIOS between baselines."""
    report = {}
    for name, info in infos.items():
        if name in times:
            info = {**info, "step_ms": summary_ms(times[name]), f"ours_over_{name}": _ratios(times, "ours", name)
                    ["of_medians"]}
            info.update({f"over_{b}": _ratios(times, name, b) for a, b in RATIOS if a == name and b in times})
        report[name] = info
    return report
