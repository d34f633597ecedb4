"""(b) At this p, device and dtype, the parallel modules match a float64 single-device reference built
from the same canonical weights: outputs, input gradients and every canonical weight gradient.

Attention: ParallelSelfAttention against `reference.reference_attention` (written apart from the
library). Model: a 2-layer GPTModel against the same model built at p = 1 in float64 on the CPU
(a group of this rank alone), loaded with the same canonical weights.
"""

from __future__ import annotations

import torch

from ..tensor_parallel import finalize_grads, manual_seed
from ..transformer import AttentionConfig, GPTModel, ParallelSelfAttention
from .compare import canonical_grads, grad_errors, relative_error, representable, verdict
from .context import BATCH, CheckContext, attention_cases, model_configs, my_chunk, seq_len
from .reference import reference_attention


def random_weights(shapes: dict[str, tuple[int, ...]], gen: torch.Generator, dtype) -> dict[str, torch.Tensor]:
    """Canonical weights with nonzero biases, representable in `dtype` (float64, CPU)."""
    return {name: representable(torch.randn(shape, generator=gen, dtype=torch.float64)
                                * (0.3 if name.endswith("weight") else 0.1), dtype)
            for name, shape in shapes.items()}


@torch.no_grad()
def mis_shard(module: ParallelSelfAttention, weights: dict[str, torch.Tensor]) -> None:
    """The classic layout bug, for --inject-fault layout: each rank keeps its chunk of the concatenated
    [q; k; v] instead of its query groups' [q heads | k | v] (off by one head where sizes differ)."""
    for part in ("weight", "bias"):
        param = getattr(module.query_key_value, part)
        if param is None:
            continue
        full = torch.cat([weights[f"{n}_proj.{part}"] for n in "qkv"])
        naive = full.chunk(module.tp_size)[module.tp_rank]
        wrong = naive if naive.shape == param.shape else param.detach().cpu().roll(module.config.head_dim, 0)
        param.copy_(wrong.to(param.device, param.dtype))


def attention_reference(cfg, weights, x, upstream, mask):
    weights = {k: v.clone().requires_grad_() for k, v in weights.items()}
    x = x.clone().requires_grad_()
    out = reference_attention(x, weights, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.causal, mask, cfg.rotary,
                              theta=cfg.rope_theta)
    (out * upstream).sum().backward()
    return out.detach(), x.grad, {k: v.grad for k, v in weights.items()}


def _attention_case(ctx: CheckContext, kwargs: dict, use_mask: bool, sp: bool, gen) -> dict[str, float]:
    """Relative errors of one attention configuration: output, input gradient, weight gradients."""
    cfg = AttentionConfig(**kwargs, params_dtype=ctx.dtype)
    module = ParallelSelfAttention(cfg, tp_group=ctx.tp_group, device=ctx.device, sequence_parallel=sp)
    weights = random_weights(module.canonical_shapes(), gen, ctx.dtype)
    module.load_canonical_state_dict(weights)
    if ctx.fault == "layout":
        mis_shard(module, weights)
    s = seq_len(ctx.tp_size)
    x = representable(torch.randn(s, BATCH, cfg.hidden_size, generator=gen, dtype=torch.float64), ctx.dtype)
    upstream = torch.randn(s, BATCH, cfg.hidden_size, generator=gen, dtype=torch.float64)
    mask = None
    if use_mask:  # batch 1 may not attend its last key
        mask = torch.ones(BATCH, 1, 1, s, dtype=torch.bool)
        mask[1, ..., -1] = False
    ref_out, ref_dx, ref_grads = attention_reference(cfg, weights, x, upstream, mask)
    local_x = my_chunk(x, ctx, sp).to(ctx.device, ctx.dtype).requires_grad_()
    out = module(local_x, None if mask is None else mask.to(ctx.device))
    (out.to(torch.float64) * my_chunk(upstream, ctx, sp).to(ctx.device)).sum().backward()
    finalize_grads(module)
    grads = canonical_grads(module)
    errors = {"output": relative_error(out, my_chunk(ref_out, ctx, sp)),
              "input grad": relative_error(local_x.grad, my_chunk(ref_dx, ctx, sp))}
    return errors | grad_errors(grads, ref_grads)


def check_attention(ctx: CheckContext) -> tuple[bool, str]:
    gen = torch.Generator().manual_seed(ctx.seed)
    errors, cases = {}, []
    for name, (kwargs, use_mask) in attention_cases(ctx.tp_size).items():
        for sp in (False, True):
            case = f"{name}{'+sp' if sp else ''}"
            cases.append(case)
            errors.update({f"{case} {k}": e for k, e in _attention_case(ctx, kwargs, use_mask, sp, gen).items()})
    return verdict(errors, ctx.dtype, " ".join(cases))


def _model_run(model: GPTModel, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    finalize_grads(model)
    return loss.detach(), canonical_grads(model)


def _model_errors(ctx: CheckContext, cfg, gen) -> dict[str, float]:
    manual_seed(ctx.seed)  # the same initial weights on every rank (torch seeds each process differently)
    reference = GPTModel(cfg, tp_group=ctx.solo_group, device="cpu", dtype=torch.float64)
    weights = {k: representable(v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype), ctx.dtype)
               for k, v in reference.canonical_state_dict().items()}
    reference.load_canonical_state_dict(weights)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, seq_len(ctx.tp_size) + 1), generator=gen)
    ref_loss, ref_grads = _model_run(reference, tokens)
    errors = {}
    for sp in (False, True):
        model = GPTModel(cfg, sequence_parallel=sp, tp_group=ctx.tp_group, device=ctx.device, dtype=ctx.dtype)
        model.load_canonical_state_dict(weights)
        loss, grads = _model_run(model, tokens.to(ctx.device))
        tag = "+sp" if sp else ""
        errors[f"{tag} loss"] = relative_error(loss, ref_loss)
        errors.update({f"{tag} {k}": e for k, e in grad_errors(grads, ref_grads).items()})
    return errors


def check_model(ctx: CheckContext) -> tuple[bool, str]:
    gen = torch.Generator().manual_seed(ctx.seed + 1)
    errors = {}
    for family, cfg in model_configs(ctx.tp_size).items():
        errors.update({f"{family}{k}": e for k, e in _model_errors(ctx, cfg, gen).items()})
    return verdict(errors, ctx.dtype, f"2-layer {'/'.join(model_configs(1))} +-sp, loss and weight grads")
