"""(i) `--ep E`: an MoE layer with its experts split over E ranks (each rank its own micro-batch, the ep group folded
over the data-parallel ranks) against the whole layer on this rank alone: each rank's output; the router's and every
expert's gradient after the data-parallel average (finalize_grads for the experts); the auxiliary losses; and the
all-to-alls of one forward (counts, dispatch, combine) and one backward (their reverse) counted.

Runs after the other checks, on the (dp, ep) groups `__main__` sets up for it (tp 1). Awkward sizes: 2 E experts of
width 24, hidden 16, top-3, 7 tokens a rank, and rank r's tokens leaning towards expert r (some experts get none).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..tensor_parallel import finalize_grads
from ..tensor_parallel.collectives import all_gather_along_dim, all_reduce
from ..tensor_parallel.parallel_state import get_expert_model_parallel_group, group_size
from ..transformer.model_config import ModelConfig
from ..transformer.moe import MoELayer, moe_step
from .compare import relative_error, verdict
from .context import CheckContext
from .counts import count_collective_kinds

TOKENS, HIDDEN = 7, 16


def _layer(cfg: ModelConfig, ctx: CheckContext, **groups) -> MoELayer:
    torch.manual_seed(ctx.seed)  # the same weights on every rank and in the reference
    return MoELayer(cfg, device=ctx.device, dtype=ctx.dtype, **groups)


def check_expert_parallel(ctx: CheckContext) -> tuple[bool, str]:
    ep_group = get_expert_model_parallel_group()
    ep, world = group_size(ep_group), ctx.world_size
    cfg = ModelConfig(hidden_size=HIDDEN, num_experts=2 * ep, moe_top_k=3, moe_ffn_hidden_size=24,
                      activation="swiglu", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    gen = torch.Generator().manual_seed(ctx.seed + 11)
    x = torch.randn(world, TOKENS, 1, HIDDEN, generator=gen).to(ctx.device, ctx.dtype)
    upstream = torch.randn(world, TOKENS, 1, HIDDEN, generator=gen).to(ctx.device, ctx.dtype)
    layer = _layer(cfg, ctx)
    with torch.no_grad():  # rank r's tokens lean towards expert r: uneven splits, idle experts
        x += 2 * layer.gate.weight[torch.arange(world) % cfg.num_experts].view(world, 1, 1, HIDDEN)
    rank, mine = dist.get_rank(), x[dist.get_rank()].clone().requires_grad_()
    with moe_step(1.0) as record, count_collective_kinds(ep_group) as forward:
        out = layer(mine)
    with moe_step(1.0), count_collective_kinds(ep_group) as backward:
        (out * upstream[rank]).sum().backward()
    finalize_grads(layer)  # the experts' average over the ranks that hold them; the router's is DDP's:
    all_reduce(layer.gate.weight.grad, dist.group.WORLD).div_(world)
    reference = _layer(cfg, ctx, ep_group=ctx.solo_group, tp_group=ctx.solo_group)
    for r in range(world):  # one micro-batch a rank, averaged as over dp
        with moe_step(1.0 / world) as reference_record:
            reference_out = reference(x[r])
            (reference_out * upstream[r]).sum().div(world).backward()
        if r == rank:
            errors = {"output": relative_error(out, reference_out.detach().double().cpu()),
                      "aux losses": relative_error(record.rows[0][0][:2],
                                                   reference_record.rows[0][0][:2].double().cpu())}
    errors["grad router"] = relative_error(layer.gate.weight.grad, reference.gate.weight.grad.double().cpu())
    for name in (reference.experts.in_name, reference.experts.out_name):
        whole = all_gather_along_dim(getattr(layer.experts, name).grad, 0, ep_group)
        errors[f"grad experts.{name}"] = relative_error(whole, getattr(reference.experts, name).grad.double().cpu())
    counted = {"forward": dict(forward), "backward": dict(backward)}
    expected = {"forward": {"all-to-all": 3}, "backward": {"all-to-all": 2}}
    wrong = [f"{k} {counted[k]} != {v}" for k, v in expected.items()
             if {n: c for n, c in counted[k].items() if "@" not in n} != v]
    ok, text = verdict(errors, ctx.dtype, f"ep {ep} of {cfg.num_experts} experts, top-3, all-to-alls counted")
    return ok and not wrong, "; ".join([text, *wrong])
