"""Context parallelism with activation recomputation (full and selective) and layout-invariant attention dropout.

A Llama-style GPTModel (GQA 4/2, rotary, packed documents) with attention dropout 0.3 (dropout_rng=
'layout_invariant': masks hashed from global (sample, head, query, key), the same at every cp) runs at cp = 2 (world
2) and tp 2 x cp 2 (world 4), both kinds, recomputation none / full / selective. float64:
- the loss and gradients equal the single process's (cp = 1, no recomputation) within 1e-10: the ring merges partial
  softmaxes by log-sum-exp and the loss is summed per part, another summation order only;
- recomputation changes nothing: the loss and every gradient equal the same layout's run without it, bit for bit (the
  same operations replayed, the dropout coordinates replayed by checkpoint_with_tp_rng);
- the collectives of one forward and one backward are counted exactly (see `_expected_counts`).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

import parallel_attention as pa
from parallel_attention.tensor_parallel.rng import dropout_coordinates
from parallel_attention.check.collective_counter import count_collectives

LAYERS = 2
SPEC = dict(vocab_size=37, hidden_size=24, num_layers=LAYERS, num_heads=4, num_kv_heads=2, activation="swiglu",
            norm="rmsnorm", position_embedding="rotary", tie_embeddings=False, ffn_hidden_size=40, max_seq_len=16,
            attention_dropout=0.3, dropout_rng="layout_invariant")
SETTINGS = {"none": {}, "full": dict(recompute_activations=True, recompute_granularity="full"),
            "selective": dict(recompute_activations=True, recompute_granularity="selective")}
TOL = dict(rtol=1e-10, atol=1e-10)
TIMEOUT_S = 240


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, 37, (2, 16), generator=g), torch.randint(0, 37, (2, 16), generator=g)
    return tokens, labels, torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])


def _run(setting, spec=SPEC, **layout):
    """Loss, gradients and the collectives of one forward and one backward (training mode, dropout on)."""
    pa.manual_seed(0)
    model = pa.GPTModel(pa.ModelConfig(**spec, **SETTINGS[setting]), dtype=torch.float64, **layout).train()
    tokens, labels, document_ids = _batch()
    with dropout_coordinates(seed=5, step=2, first_sample=0):
        with count_collectives() as forward:
            loss = model(tokens, labels, document_ids=document_ids)
        with count_collectives() as backward:
            loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, dict(forward), dict(backward)


def _worker(tp, cp, kind):
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(tp, context_parallel_size=cp)
    results = {}
    for setting in SETTINGS:
        loss, grads, forward, backward = _run(setting, context_parallel_kind=kind)
        for grad in grads.values():  # what DDP over dp x cp does
            dist.all_reduce(grad, group=pa.get_context_parallel_group())
            grad /= cp
        results[setting] = (loss, grads, forward, backward)
    return results


def _expected_counts(tp, cp, kind, setting):
    """Per forward and backward of the model (LAYERS layers, tp without SP), on each rank.

    Without recomputation, per layer: ring forward cp - 1 exchanges (one batch_isend_irecv each), backward 2 cp - 1 (k/v on,
    dK/dV home); all_to_all 3 all-to-alls each way. TP (no SP): per layer 2 all-reduces each way (attention, MLP);
    outside the layers 3 forward (the vocab-parallel embedding's, the cross entropy's 2) and 1 backward (the output
    layer's input). The loss's mean over cp: 2 all-reduces forward (sum, count), 1 backward.
    Full recomputation replays each layer's whole forward in backward: the ring's cp - 1 exchanges or the
    all-to-all's 3 again, and under TP its 2 all-reduces. Selective recomputation of the all-to-all recomputes the
    local core only (no collective); the ring keeps only q, k, v, its output and the lse (nothing s x s, its dropout
    masks hashed again in backward), so selective leaves it as it is: the counts of no recomputation.
    """
    ring_fwd, ring_bwd = (cp - 1, 2 * cp - 1) if kind == "ring" else (0, 0)
    batches_fwd, batches_bwd = (cp - 1, cp + 1) if kind == "ring" else (0, 0)  # one batch_isend_irecv per ring step
    a2a = 3 if kind == "all_to_all" else 0
    tp_fwd, tp_bwd = (2 * LAYERS + 3, 2 * LAYERS + 1) if tp > 1 else (0, 0)
    forward = dict(all_reduce=2 + tp_fwd, isend=LAYERS * ring_fwd, irecv=LAYERS * ring_fwd,
                   batch_isend_irecv=LAYERS * batches_fwd, all_to_all_single=LAYERS * a2a)
    replay = LAYERS if setting == "full" else 0  # layers whose forward runs again in backward
    backward = dict(all_reduce=1 + tp_bwd + (2 * replay if tp > 1 else 0), isend=LAYERS * ring_bwd + replay * ring_fwd,
                    irecv=LAYERS * ring_bwd + replay * ring_fwd, all_to_all_single=LAYERS * a2a + replay * a2a,
                    batch_isend_irecv=LAYERS * batches_bwd + replay * batches_fwd)
    return ({k: n for k, n in forward.items() if n}, {k: n for k, n in backward.items() if n})


CASES = [(2, 1, 2, "ring"), (2, 1, 2, "all_to_all"), (4, 2, 2, "ring")]


@pytest.mark.parametrize("world,tp,cp,kind", CASES, ids=[f"tp{c[1]}-cp{c[2]}-{c[3]}" for c in CASES])
def test_recompute_under_cp_changes_no_number_and_counts_its_collectives(world, tp, cp, kind):
    want_loss, want_grads, _, _ = _run("none")  # the single process: cp = 1, no recomputation
    assert not torch.allclose(want_loss, _run("none", {**SPEC, "attention_dropout": 0.0})[0])  # dropout drops
    for results in run_distributed(_worker, world, world, tp, cp, kind, timeout=TIMEOUT_S):
        base_loss, base_grads = results["none"][:2]
        for setting, (loss, grads, forward, backward) in results.items():
            torch.testing.assert_close(loss, want_loss, **TOL, msg=setting)
            assert torch.equal(loss, base_loss), setting
            differ = [n for n, g in grads.items() if not torch.equal(g, base_grads[n])]
            assert not differ, (setting, differ)
            if tp == 1:  # the single process's parameter shapes
                for name, grad in grads.items():
                    torch.testing.assert_close(grad, want_grads[name], **TOL, msg=f"{setting}: {name}")
            assert (forward, backward) == _expected_counts(tp, cp, kind, setting), setting


def _hidden_dropout_worker(tp, cp, sequence_parallel):
    from parallel_attention.transformer.context_parallel import split_for_context_parallel
    from parallel_attention.transformer.dropout import DropoutSite, build_hidden_dropout

    pa.destroy_model_parallel()
    pa.initialize_model_parallel(tp, context_parallel_size=cp)
    x = torch.randn(24, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))  # [s, b, h]
    drop = lambda **groups: build_hidden_dropout(0.4, "layout_invariant", sequence_parallel,  # noqa: E731
                                                 site=DropoutSite.MLP_OUTPUT, layer=1, **groups).train()
    with dropout_coordinates(seed=2, step=3, first_sample=4):
        want = drop(tp_group=None)(x)  # one process: the whole sequence
        part = split_for_context_parallel(x, pa.get_context_parallel_group())
        want = split_for_context_parallel(want, pa.get_context_parallel_group())
        if sequence_parallel:
            part, want = (t.chunk(tp, dim=0)[pa.get_tensor_model_parallel_rank()] for t in (part, want))
        got = drop(tp_group=pa.get_tensor_model_parallel_group(), cp_group=pa.get_context_parallel_group())(part)
    return torch.equal(got, want), bool((got == 0).any())


@pytest.mark.parametrize("tp,cp,sequence_parallel", [(1, 2, False), (1, 4, False), (2, 2, True), (2, 2, False)])
def test_layout_invariant_hidden_dropout_draws_the_masks_of_cp_1(tp, cp, sequence_parallel):
    for same, dropped in run_distributed(_hidden_dropout_worker, 4, 4, tp, cp, sequence_parallel, timeout=TIMEOUT_S):
        assert same and dropped


@pytest.mark.parametrize("s,tp,cp", [(24, 3, 2), (48, 4, 3), (12, 1, 3), (16, 2, 2)])
def test_the_zigzag_runs_are_the_positions_this_rank_holds(s, tp, cp):
    from parallel_attention.transformer.context_parallel import zigzag_indices
    from parallel_attention.transformer.dropout import _zigzag_runs

    for cp_rank in range(cp):
        part = zigzag_indices(s, cp, cp_rank)
        for piece, want in enumerate(part.chunk(tp)):  # pieces straddle the two chunks when tp is odd
            runs = _zigzag_runs(s // (cp * tp), tp, piece, cp, cp_rank)
            assert torch.cat([torch.arange(a, a + n) for a, n in runs]).tolist() == want.tolist()
