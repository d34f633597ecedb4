"""Packed documents under context parallelism: the loss of a packed batch equals the token mean of transformers'
losses on each document run alone (LlamaForCausalLM, tiny, same weights through parallel_attention.hf) at
(tp, cp) = (1, 2) and (2, 2), for both kinds (ring, all_to_all), with odd document lengths and single-token
documents; its gradients, averaged over cp as DDP averages over dp x cp, equal one process's with document_ids.

One world of 4 on gloo serves every case (tp 1 x cp 2 x dp 2, tp 2 x cp 2); float32 as transformers runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", reason="the reference is transformers' LlamaForCausalLM")

import parallel_attention as pa  # noqa: E402
from distributed import run_distributed  # noqa: E402
import test_documents_model  # noqa: E402
from test_model import _canonical_grads  # noqa: E402

_batch = test_documents_model._batch
llama = test_documents_model.llama  # the module-scoped fixture: transformers' per-document loss, the import

LAYOUTS = [(1, 2, "ring"), (1, 2, "all_to_all"), (2, 2, "ring"), (2, 2, "all_to_all")]
WORLD, TIMEOUT_S = 4, 240


def _loss_and_grads(model: pa.GPTModel, cp: int) -> tuple[float, float, dict[str, torch.Tensor]]:
    """(the packed loss with document_ids, without them, the canonical gradients of the first averaged over cp)."""
    tokens, ids, labels = _batch()
    loss = model(tokens, labels, document_ids=ids)
    loss.backward()
    if cp > 1:
        for p in model.parameters():  # what DDP over dp x cp does (the dp replicas hold equal gradients here)
            dist.all_reduce(p.grad, group=pa.get_context_parallel_group())
            p.grad /= cp
    with torch.no_grad():
        unmasked = model(tokens, labels).item()
    return loss.item(), unmasked, _canonical_grads(model)


def _layouts_worker(cfg: pa.ModelConfig, canonical: dict) -> dict:
    results = {}
    for tp, cp, kind in LAYOUTS:
        pa.destroy_model_parallel()
        pa.initialize_model_parallel(tp, context_parallel_size=cp)
        model = pa.GPTModel(cfg, context_parallel_kind=kind)
        model.load_canonical_state_dict(canonical)
        results[(tp, cp, kind)] = _loss_and_grads(model, cp)
    return results


@pytest.fixture(scope="module")
def per_rank(llama):
    _, (cfg, canonical) = llama
    return run_distributed(_layouts_worker, WORLD, 1, cfg, canonical, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def one_process(llama):
    _, (cfg, canonical) = llama
    model = pa.GPTModel(cfg)
    model.load_canonical_state_dict(canonical)
    return _loss_and_grads(model, 1)


@pytest.mark.parametrize("tp,cp,kind", LAYOUTS, ids=[f"tp{t}-cp{c}-{k}" for t, c, k in LAYOUTS])
def test_packed_loss_under_cp_is_the_token_mean_of_transformers_losses_per_document(llama, per_rank, tp, cp, kind):
    reference, _ = llama
    for results in per_rank:
        packed, unmasked, _ = results[(tp, cp, kind)]
        # float32 against float32, same weights: only summation orders differ (~1e-7); a document crossed or a
        # position not restarted moves the loss by ~1e-2
        assert packed == pytest.approx(reference, abs=1e-5)
        assert abs(unmasked - reference) > 1e-3


@pytest.mark.parametrize("tp,cp,kind", LAYOUTS, ids=[f"tp{t}-cp{c}-{k}" for t, c, k in LAYOUTS])
def test_packed_gradients_under_cp_equal_one_process(one_process, per_rank, tp, cp, kind):
    want_loss, _, want_grads = one_process
    for results in per_rank:
        loss, _, grads = results[(tp, cp, kind)]
        assert loss == pytest.approx(want_loss, abs=1e-6)
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            # float32: the ring's log-sum-exp merge and the per-part loss sums reorder additions (measured <= 6e-8)
            torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-6, msg=name)
