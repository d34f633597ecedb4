"""(d) One attention block issues exactly the documented collectives, all on the tensor-parallel group.

Expected, per attention block (docs/architecture.md, "Where sequence parallelism is decided"):

    p = 1                   forward: none                               backward: none
    p > 1                   forward: 1 all-reduce                       backward: 1 all-reduce
    p > 1, sequence par.    forward: 1 all-gather + 1 reduce-scatter    backward: 2 all-gathers + 1 reduce-scatter
                                                                        (QKV re-gathers its input: Korthikanti)

Counted by `collective_counter` for the duration of one forward and, separately, one backward; a collective on
another group is counted under `name@other-group`.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

from ..tensor_parallel import manual_seed
from ..transformer import AttentionConfig, ParallelSelfAttention
from .collective_counter import count_collectives
from .context import BATCH, CheckContext, attention_cases, my_chunk, seq_len

# every spelling torch has had, counted under one name each
_KIND = {"all_reduce": "all-reduce", "all_gather": "all-gather", "all_gather_into_tensor": "all-gather",
         "all_gather_single": "all-gather", "reduce_scatter": "reduce-scatter",
         "reduce_scatter_tensor": "reduce-scatter", "reduce_scatter_single": "reduce-scatter",
         "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
         "all_to_all": "all-to-all", "all_to_all_single": "all-to-all", "barrier": "barrier",
         "send": "send", "recv": "recv", "isend": "send", "irecv": "recv", "batch_isend_irecv": "batched exchange"}


def expected_counts(p: int, sequence_parallel: bool) -> tuple[Counter, Counter]:
    """(forward, backward) collectives of one attention block on the tensor-parallel group."""
    if p == 1:
        return Counter(), Counter()
    if not sequence_parallel:
        return Counter({"all-reduce": 1}), Counter({"all-reduce": 1})
    # backward: the query_key_value projection all-gathers its kept [s/p, b, h] input again (Korthikanti)
    return Counter({"all-gather": 1, "reduce-scatter": 1}), Counter({"all-gather": 2, "reduce-scatter": 1})


@contextlib.contextmanager
def count_collective_kinds(group):
    """The library's counter (`collective_counter`) under the self-check's names, one per kind of collective
    (isend and send are both "send"); calls on another group count under `kind@other-group`."""
    kinds: Counter = Counter()
    with count_collectives(group) as calls:
        yield kinds
    for name, n in calls.items():
        op, at, other = name.partition("@")
        kinds[_KIND[op] + at + other] += n


def _describe(counts: Counter) -> str:
    return " + ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"


def _count_block(ctx: CheckContext, kwargs: dict, sp: bool) -> tuple[Counter, Counter]:
    cfg = AttentionConfig(**kwargs, params_dtype=ctx.dtype)
    manual_seed(ctx.seed)
    module = ParallelSelfAttention(cfg, tp_group=ctx.tp_group, device=ctx.device, sequence_parallel=sp)
    x = torch.randn(seq_len(ctx.tp_size), BATCH, cfg.hidden_size, device=ctx.device, dtype=ctx.dtype)
    x = my_chunk(x, ctx, sp).requires_grad_()
    with count_collective_kinds(ctx.tp_group) as forward:
        out = module(x)
    with count_collective_kinds(ctx.tp_group) as backward:
        out.float().sum().backward()
    return forward, backward


def check_collective_count(ctx: CheckContext) -> tuple[bool, str]:
    wrong, seen = [], {}
    for name, (kwargs, _) in attention_cases(ctx.tp_size).items():
        for sp in (False, True):
            forward, backward = _count_block(ctx, kwargs, sp)
            want_forward, want_backward = expected_counts(ctx.tp_size, sp)
            seen[sp] = f"fwd {_describe(forward)}, bwd {_describe(backward)}"
            if forward != want_forward or backward != want_backward:
                wrong.append(f"{name}{'+sp' if sp else ''}: fwd {_describe(forward)}, bwd {_describe(backward)} "
                             f"(expected fwd {_describe(want_forward)}, bwd {_describe(want_backward)})")
    if wrong:
        return False, "; ".join(wrong)
    return True, f"per attention block: {seen[False]}; sequence parallel: {seen[True]}"
