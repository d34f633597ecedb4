"""Context-parallel attention (ring and all_to_all) against the float64 single-device reference.

A world of 4 on gloo (the reused rank pool); each case sets up the (tp, cp) groups it needs (dp = 4 / (tp cp)).
Every rank feeds its zigzag part of the same full sequence (under SP, its tensor-parallel piece of that part) and
compares its output and input gradient with the reference's same rows; the weight gradients, summed over cp (the
parameters are replicated across cp, each rank's gradient covers its own tokens), with the reference's slice.
Sizes awkward on purpose: h 20, heads of 6, s 16 (2 cp tp divides it up to cp 4 or tp 2 x cp 2 under SP).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from attention_inputs import load_random_weights_and_data
from distributed import run_distributed
from fused_rows import expected_fused_rows
from refusals import value_error_messages

import parallel_attention as pa
from parallel_attention.transformer.context_parallel import (gather_from_context_parallel, split_for_context_parallel,
                                                             zigzag_indices)
from parallel_attention.transformer.context_parallel.ring_attention import BlockMasks, RingPlan
from parallel_attention.transformer.documents import DocumentLayout
from parallel_attention.check.reference import reference_attention
from parallel_attention.check.collective_counter import count_collectives

S, B, H, D = 16, 2, 20, 6
TOL = dict(rtol=1e-10, atol=1e-10)  # float64: the ring merges partial softmaxes by lse, another summation order
TIMEOUT_S = 240

# packed documents of odd lengths that straddle the zigzag chunks (and a row of one document)
DOCUMENT_IDS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [3] * 16])

# (tp, cp, kind, nh, nkv, sequence_parallel, causal, rotary[, documents])
CASES = [
    (1, 2, "ring", 4, 2, False, True, True),
    (1, 2, "ring", 4, 4, False, False, False),
    (1, 4, "ring", 4, 1, False, True, True),
    (2, 2, "ring", 4, 1, False, True, True),  # p > nkv
    (2, 2, "ring", 4, 2, True, True, True),  # SP: [s / (cp tp), b, h]
    (1, 2, "all_to_all", 4, 2, False, True, True),
    (1, 2, "all_to_all", 4, 1, False, True, False),  # MQA: the k/v head replicated for cp
    (2, 2, "all_to_all", 4, 1, True, True, True),
    (1, 4, "all_to_all", 4, 2, False, False, True),
    (1, 2, "ring", 4, 2, False, True, True, True),
    (1, 4, "ring", 4, 2, False, False, True, True),
    (2, 2, "ring", 4, 1, True, True, True, True),
    (1, 2, "all_to_all", 4, 2, False, True, True, True),
]


def _local(t, cp_group, tp, sp):
    part = split_for_context_parallel(t, cp_group)
    return part.chunk(tp, dim=0)[pa.get_tensor_model_parallel_rank()] if sp else part


def _case_worker(tp, cp, kind, nh, nkv, sp, causal, rotary, documents=False):
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(tp, context_parallel_size=cp)
    cp_group = pa.get_context_parallel_group()
    cfg = pa.AttentionConfig(hidden_size=H, num_heads=nh, num_kv_heads=nkv, head_dim=D, rotary=rotary, causal=causal,
                             params_dtype=torch.float64)
    module = pa.ParallelSelfAttention(cfg, sequence_parallel=sp, context_parallel_kind=kind)
    # identical weights and data on every rank
    weights, x, upstream = load_random_weights_and_data(module, torch.Generator().manual_seed(11), (S, B, H))
    layout = DocumentLayout.from_ids(DOCUMENT_IDS) if documents else None
    index = torch.arange(S)
    mask, positions = (layout.mask(index, index, False), layout.positions) if documents else (None, None)
    ref = reference_attention(x, weights, nh, nkv, D, causal, mask, rotary, positions)
    ref.backward(upstream)
    x_in = _local(x.detach(), cp_group, tp, sp).requires_grad_()
    with count_collectives() as forward:
        out = module(x_in, documents=layout)
    with count_collectives() as backward:
        out.backward(_local(upstream, cp_group, tp, sp))
    torch.testing.assert_close(out, _local(ref.detach(), cp_group, tp, sp), **TOL)
    torch.testing.assert_close(x_in.grad, _local(x.grad, cp_group, tp, sp), **TOL)
    pa.finalize_grads(module)  # k/v replicas (p > nkv) sum their shares over tp, as training does
    qkv, dense = module.query_key_value.weight.grad, module.dense.weight.grad
    for grad in (qkv, dense):
        dist.all_reduce(grad, group=cp_group)
    p, r = module.tp_size, module.tp_rank
    grads = [weights[f"{n}.weight"].grad for n in ("q_proj", "k_proj", "v_proj")]
    torch.testing.assert_close(qkv, expected_fused_rows(*grads, r, p, nh, nkv, D), **TOL)
    torch.testing.assert_close(dense, weights["o_proj.weight"].grad.chunk(p, dim=1)[r], **TOL)
    return dict(forward), dict(backward)


def _expected_counts(tp, cp, kind, sp):
    """Per layer on each rank. TP's own (docs/architecture.md, "Communication per block"): 1 all-reduce each
    way; SP: all-gather + reduce-scatter forward, the same plus 1 re-gather backward. Ring: cp - 1 exchanges forward, 2 cp - 1 backward (k/v on, dK/dV home),
    sent in one batch_isend_irecv per ring step. all_to_all: q, k and v (stacked), output: 3 each way."""
    forward, backward = {}, {}
    if tp > 1 and sp:
        forward = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
        backward = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 1}
    elif tp > 1:
        forward, backward = {"all_reduce": 1}, {"all_reduce": 1}
    if kind == "ring":
        # one batched exchange per ring step: forward cp - 1; backward cp (k/v on with the dK/dV behind them) + 1
        forward.update(isend=cp - 1, irecv=cp - 1, batch_isend_irecv=cp - 1)
        backward.update(isend=2 * cp - 1, irecv=2 * cp - 1, batch_isend_irecv=cp + 1)
    else:
        forward.update(all_to_all_single=3)
        backward.update(all_to_all_single=3)
    return forward, backward


@pytest.mark.parametrize("case", CASES, ids=[f"tp{c[0]}-cp{c[1]}-{c[2]}-nkv{c[4]}{'-sp' if c[5] else ''}"
                                             f"{'-causal' if c[6] else ''}{'-rotary' if c[7] else ''}"
                                             f"{'-documents' if c[8:] else ''}" for c in CASES])
def test_context_parallel_attention_equals_the_reference_and_counts_its_collectives(case):
    tp, cp, kind, sp = case[0], case[1], case[2], case[5]
    for forward, backward in run_distributed(_case_worker, 4, 4, *case, timeout=TIMEOUT_S):
        assert (forward, backward) == _expected_counts(tp, cp, kind, sp)


def _balance_worker(cp):
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1, context_parallel_size=cp)
    return RingPlan(pa.get_context_parallel_group(), BlockMasks(4, causal=True), 1).computed_pairs()


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_zigzag_gives_every_rank_the_same_block_pairs(cp):
    pairs = run_distributed(_balance_worker, 4, 4, cp, timeout=TIMEOUT_S)
    assert max(pairs) - min(pairs) <= 1 and pairs == [2 * cp + 1] * 4, pairs  # 2 diagonal + 2 cp - 1 full, of 4 cp


def _refusals_worker():
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1, context_parallel_size=2)
    ring = dict(context_parallel_kind="ring")
    cfg = pa.AttentionConfig(hidden_size=H, num_heads=3, num_kv_heads=1, head_dim=D)
    return value_error_messages(
        lambda: pa.ParallelSelfAttention(cfg, context_parallel_kind="all_to_all"),
        lambda: pa.ParallelSelfAttention(cfg, context_parallel_kind="ulysses"),
        lambda: pa.ParallelSelfAttention(pa.AttentionConfig(hidden_size=H, num_heads=4, head_dim=D,
                                                            attention_dropout=0.1), **ring),
        lambda: pa.ParallelSelfAttention(cfg, **ring)(torch.randn(3, B, H)),
        lambda: pa.ParallelSelfAttention(cfg, **ring)(torch.randn(4, B, H), torch.ones(1, 1, 1, 8, dtype=torch.bool)))


def test_context_parallel_refusals_name_the_values_and_the_fix():
    messages = run_distributed(_refusals_worker, 4, 4, timeout=TIMEOUT_S)[0]
    assert len(messages) == 5, messages
    assert "(3) divisible by context_parallel_size=2" in messages[0] and "'ring'" in messages[0]
    assert "'ulysses' is not one of ('ring', 'all_to_all')" in messages[1]
    # attention dropout under CP needs the hashed masks (the tensor-parallel generator's cannot equal cp = 1's)
    assert "attention_dropout=0.1 needs dropout_rng='layout_invariant' (got 'per_rank')" in messages[2]
    assert "s=6 is not divisible by 2 x context_parallel_size=2 = 4" in messages[3]
    assert "takes no attention_mask" in messages[4]


def _zigzag_worker(cp):
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1, context_parallel_size=cp)
    group = pa.get_context_parallel_group()
    full = torch.arange(2 * 3 * S).view(2, 3 * S).double()  # s = 48 along dim 1
    part = split_for_context_parallel(full, group, dim=1)
    return part[0].long().tolist(), torch.equal(gather_from_context_parallel(part, group, dim=1), full)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_zigzag_split_holds_chunks_r_and_2cp_1_r_and_gathers_back(cp):
    m = 3 * S // (2 * cp)
    for rank, (indices, gathered) in enumerate(run_distributed(_zigzag_worker, 4, 4, cp, timeout=TIMEOUT_S)):
        r = rank % cp  # cp innermost of dp here (tp = 1)
        chunks = [list(range(c * m, (c + 1) * m)) for c in (r, 2 * cp - 1 - r)]
        assert indices == chunks[0] + chunks[1] == zigzag_indices(3 * S, cp, r).tolist() and gathered, rank


def _dropout_worker(kind):
    from parallel_attention.tensor_parallel.rng import dropout_coordinates

    cfg = pa.AttentionConfig(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=D, rotary=True,
                             params_dtype=torch.float64, attention_dropout=0.3, dropout_rng="layout_invariant")
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1)  # cp = 1: the reference block keeps these groups
    torch.manual_seed(2)
    reference = pa.ParallelSelfAttention(cfg).train()
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1, context_parallel_size=2)
    cp_group = pa.get_context_parallel_group()
    module = pa.ParallelSelfAttention(cfg, context_parallel_kind=kind).train()
    module.load_state_dict(reference.state_dict())
    x = torch.randn(S, B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with dropout_coordinates(seed=3, step=1, first_sample=0):
        want, got = reference(x), module(split_for_context_parallel(x, cp_group))
        undropped = reference.eval()(x)
    # all_to_all runs the block's own core on the full sequence: the same operations, bit for bit; the ring merges
    # the dropped blocks by log-sum-exp, another summation order (float64: 1e-12)
    close = torch.equal if kind == "all_to_all" else lambda a, b: torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    return close(got, split_for_context_parallel(want, cp_group)), torch.allclose(want, undropped)


@pytest.mark.parametrize("kind", ["all_to_all", "ring"])
def test_layout_invariant_dropout_draws_the_masks_of_cp_1(kind):
    for same, like_no_dropout in run_distributed(_dropout_worker, 4, 4, kind, timeout=TIMEOUT_S):
        assert same and not like_no_dropout
