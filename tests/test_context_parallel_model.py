"""GPTModel under context parallelism: every cp rank takes the full [b, s] tokens and labels, keeps its zigzag part,
and returns the single-process token-mean loss; its gradients, averaged over cp as DDP averages over dp x cp, equal
the single process's.

World of 4 on gloo (dp = 4 / (tp cp)); the reference is the same seeded model in the test process (world of one).
float64: the ring merges softmaxes by log-sum-exp and the loss is summed per part, so only the summation order
differs (tolerance 1e-10).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from refusals import value_error_messages

import parallel_attention as pa

LLAMA_LIKE = dict(vocab_size=37, hidden_size=24, num_layers=2, num_heads=4, num_kv_heads=1, activation="swiglu",
                  norm="rmsnorm", position_embedding="rotary", tie_embeddings=False, qkv_bias=False, out_bias=False,
                  mlp_bias=False, ffn_hidden_size=40, max_seq_len=16)
GPT2_LIKE = dict(vocab_size=37, hidden_size=24, num_layers=2, num_heads=4, max_seq_len=16)  # learned positions
TOL = dict(rtol=1e-10, atol=1e-10)
TIMEOUT_S = 240


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 37, (2, 16), generator=g)
    labels = torch.randint(0, 37, (2, 16), generator=g)
    labels[0, :3] = -100  # ignored labels: the mean is over the global count
    document_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    return tokens, labels, document_ids


def _loss_and_grads(model, documents):
    tokens, labels, document_ids = _batch()
    loss = model(tokens, labels, document_ids=document_ids if documents else None)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _worker(spec, tp, cp, kind, documents):
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(tp, context_parallel_size=cp)
    pa.manual_seed(0)
    model = pa.GPTModel(pa.ModelConfig(**spec), dtype=torch.float64, context_parallel_kind=kind)
    loss, grads = _loss_and_grads(model, documents)
    for grad in grads.values():  # what DDP over dp x cp does (the dp replicas hold equal gradients here)
        dist.all_reduce(grad, group=pa.get_context_parallel_group())
        grad /= cp
    return loss, grads if tp == 1 else None


CASES = [(LLAMA_LIKE, 1, 2, "ring", False), (LLAMA_LIKE, 1, 4, "ring", True), (LLAMA_LIKE, 1, 2, "all_to_all", True),
         (GPT2_LIKE, 1, 2, "ring", True), (GPT2_LIKE, 1, 2, "all_to_all", False), (LLAMA_LIKE, 2, 2, "ring", True),
         (LLAMA_LIKE, 2, 2, "all_to_all", False)]


@pytest.mark.parametrize("spec,tp,cp,kind,documents", CASES,
                         ids=[f"{'llama' if c[0] is LLAMA_LIKE else 'gpt2'}-tp{c[1]}-cp{c[2]}-{c[3]}"
                              f"{'-documents' if c[4] else ''}" for c in CASES])
def test_the_model_under_cp_gives_the_single_process_loss_and_gradients(spec, tp, cp, kind, documents):
    pa.manual_seed(0)
    want_loss, want_grads = _loss_and_grads(pa.GPTModel(pa.ModelConfig(**spec), dtype=torch.float64), documents)
    for loss, grads in run_distributed(_worker, 4, 4, spec, tp, cp, kind, documents, timeout=TIMEOUT_S):
        torch.testing.assert_close(loss, want_loss, **TOL)
        if grads is not None:  # tp = 1: the same parameter shapes as the single process
            assert grads.keys() == want_grads.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(grad, want_grads[name], **TOL, msg=name)


def _decoding_refusals_worker():
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1, context_parallel_size=2)
    model = pa.GPTModel(pa.ModelConfig(**LLAMA_LIKE))
    tokens = torch.zeros(1, 4, dtype=torch.long)
    return value_error_messages(lambda: model.decode(tokens, model.new_kv_cache(1, 8)),
                                lambda: model.next_token_logits(tokens))


def test_decoding_under_cp_is_refused_by_name():
    messages = run_distributed(_decoding_refusals_worker, 4, 4, timeout=TIMEOUT_S)[0]
    assert len(messages) == 2 and all("context parallel size 1" in m and "2" in m for m in messages), messages
