"""(g) `--cp C`: context-parallel attention of both kinds (ring, all_to_all) against the float64 reference, with and
without packed documents: output, input gradient and every canonical weight gradient (summed over cp, where each
rank's covers its own tokens), and the collectives of one forward and one backward counted per kind.

Runs after the other checks, on the ("dp", "cp", "tp") groups that `__main__` sets up for it. Every rank feeds its
zigzag part of the same full sequence (s = 4 cp, awkward head sizes as in `context`).
"""

from __future__ import annotations

import torch

from ..tensor_parallel import finalize_grads
from ..tensor_parallel.collectives import all_reduce
from ..tensor_parallel.parallel_state import get_context_parallel_group, group_size
from ..transformer import AttentionConfig, ParallelSelfAttention
from ..transformer.context_parallel import CONTEXT_PARALLEL_KINDS, split_for_context_parallel
from ..transformer.documents import DocumentLayout
from .compare import canonical_grads, grad_errors, relative_error, verdict
from .context import BATCH, HEAD_DIM, HIDDEN, CheckContext
from .counts import count_collective_kinds
from .equivalence import attention_reference, random_weights


def _expected_p2p(kind: str, cp: int) -> tuple[dict, dict]:
    """(forward, backward) collectives on the context-parallel group of one attention block."""
    if kind == "ring":  # sends: cp - 1 forward; backward cp - 1 (k, v) + cp (dK, dV home); one batch per ring step
        return ({"send": cp - 1, "recv": cp - 1, "batched exchange": cp - 1},
                {"send": 2 * cp - 1, "recv": 2 * cp - 1, "batched exchange": cp + 1})
    return {"all-to-all": 3}, {"all-to-all": 3}  # q, k and v stacked, the output


def _case(ctx: CheckContext, kind: str, documents: bool, gen) -> tuple[dict[str, float], list[str]]:
    cp_group = get_context_parallel_group()
    cp = group_size(cp_group)
    s = 4 * cp
    cfg = AttentionConfig(hidden_size=HIDDEN, head_dim=HEAD_DIM, num_heads=2 * ctx.tp_size * cp, num_kv_heads=1,
                          rotary=not documents, params_dtype=ctx.dtype)
    module = ParallelSelfAttention(cfg, tp_group=ctx.tp_group, cp_group=cp_group, device=ctx.device,
                                   context_parallel_kind=kind)
    weights = random_weights(module.canonical_shapes(), gen, ctx.dtype)
    module.load_canonical_state_dict(weights)
    ids = torch.tensor([[0] * (s // 2 + 1) + [1] * (s // 2 - 1)] * BATCH)
    layout = DocumentLayout.from_ids(ids.to(ctx.device)) if documents else None
    index = torch.arange(s)
    mask = DocumentLayout.from_ids(ids).mask(index, index, False) if documents else None
    x = torch.randn(s, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    upstream = torch.randn(s, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    ref_out, ref_dx, ref_grads = attention_reference(cfg, weights, x, upstream, mask)
    mine = lambda t: split_for_context_parallel(t, cp_group)  # noqa: E731
    local_x = mine(x).to(ctx.device, ctx.dtype).requires_grad_()
    with count_collective_kinds(cp_group) as forward:
        out = module(local_x, documents=layout)
    with count_collective_kinds(cp_group) as backward:
        (out.to(torch.float64) * mine(upstream).to(ctx.device)).sum().backward()
    finalize_grads(module)
    for param in module.parameters():
        all_reduce(param.grad, cp_group)
    errors = {"output": relative_error(out, mine(ref_out)), "input grad": relative_error(local_x.grad, mine(ref_dx))}
    want_fwd, want_bwd = _expected_p2p(kind, cp)
    counts = [f"{kind} {name} {dict(got)} != {want}" for name, got, want in
              (("forward", forward, want_fwd), ("backward", backward, want_bwd))
              if {k: v for k, v in got.items() if "@" not in k} != want]
    return errors | grad_errors(canonical_grads(module), ref_grads), counts


def check_context_parallel(ctx: CheckContext) -> tuple[bool, str]:
    gen = torch.Generator().manual_seed(ctx.seed + 7)
    errors, wrong_counts = {}, []
    for kind in CONTEXT_PARALLEL_KINDS:
        for documents in (False, True):
            case_errors, counts = _case(ctx, kind, documents, gen)
            errors.update({f"{kind}{'+documents' if documents else ''} {k}": e for k, e in case_errors.items()})
            wrong_counts += counts
    ok, text = verdict(errors, ctx.dtype, "ring all_to_all, +-documents, collectives counted")
    return ok and not wrong_counts, "; ".join([text, *wrong_counts])
