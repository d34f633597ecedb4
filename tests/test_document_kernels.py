"""SDPA's document kernels (transformer/kernels/document_kernels.py) on CPU: the varlen path's packing, cumulative lengths,
causal window and grouped heads, checked with a varlen operator written here (softmax attention per packed
sequence, float32), since torch's varlen_attn runs on CUDA only; its CUDA call itself is checked under fake tensors
(test_cuda_contracts.py) and numerically by scripts/gpu_check.sh.

Inputs are rounded to bf16 once; the reference (one SDPA call per document) runs float32 on the same values, so the
varlen path's output, rounded to bf16 once, is within one bf16 ulp of the largest value (eps 2^-7 x max |ref|).
"""

from __future__ import annotations

import math

import pytest
import torch

from parallel_attention.transformer.kernels.document_kernels import PER_DOCUMENT_SDPA, VarlenDocuments, varlen_kernel
from parallel_attention.transformer.documents import DocumentLayout

B, NH, NKV, S, D = 2, 4, 2, 40, 8
ROWS = [[0] * 7 + [1] + [2] * 31 + [3], [5] * 13 + [6] * 27]  # odd lengths, single tokens, rows that differ


def _varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, enable_gqa):
    """varlen_attn's contract, plainly: each packed sequence [cu[i], cu[i+1]) attends only itself; window (-1, 0) is
    causal; k/v heads shared by groups of query heads when enable_gqa."""
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and enable_gqa == (k.shape[1] != q.shape[1])
    out = torch.empty_like(q)
    for a, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs, ks, vs = (t[a:e].float().transpose(0, 1) for t in (q, k, v))  # [heads, length, d]
        ks, vs = (t.repeat_interleave(q.shape[1] // k.shape[1], 0) for t in (ks, vs))
        scores = qs @ ks.transpose(1, 2) / math.sqrt(q.shape[-1])
        if tuple(window_size) == (-1, 0):
            scores = scores.masked_fill(~torch.ones(e - a, e - a, dtype=torch.bool).tril(), float("-inf"))
        out[a:e] = (torch.softmax(scores, -1) @ vs).transpose(0, 1).to(q.dtype)
    return out


def test_a_layout_holds_the_packed_cumulative_lengths_and_the_longest_document():
    layout = DocumentLayout.from_ids(torch.tensor(ROWS))
    assert layout.cu_seqlens.dtype == torch.int32 and layout.cu_seqlens.device == layout.segments.device
    assert layout.cu_seqlens.tolist() == [0, 7, 8, 39, 40, 53, 80] and layout.max_length == 31


@pytest.mark.parametrize("causal", [True, False])
def test_the_varlen_path_packs_the_batch_into_one_call_equal_to_one_sdpa_call_per_document(causal):
    g, calls = torch.Generator().manual_seed(4), []
    q = torch.randn(B, NH, S, D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, NKV, S, D, generator=g).to(torch.bfloat16) for _ in "kv")
    layout = DocumentLayout.from_ids(torch.tensor(ROWS))
    kernel = VarlenDocuments(lambda *args, **kwargs: calls.append(1) or _varlen_reference(*args, **kwargs))
    got = kernel(q, k, v, layout, causal, 0.0)
    want = PER_DOCUMENT_SDPA(q.float(), k.float(), v.float(), layout, causal, 0.0)
    assert calls == [1] and got.shape == (B, NH, S, D) and got.dtype == torch.bfloat16
    one_ulp = torch.finfo(torch.bfloat16).eps * want.abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=0, atol=one_ulp)


def test_a_float32_call_takes_one_sdpa_call_per_document():
    """varlen_attn (FlashAttention-2) runs bf16 / fp16 only."""
    q, k, v = torch.randn(B, NH, S, D), torch.randn(B, NKV, S, D), torch.randn(B, NKV, S, D)
    layout = DocumentLayout.from_ids(torch.tensor(ROWS))
    kernel = VarlenDocuments(lambda *args, **kwargs: pytest.fail("varlen_attn called in float32"))
    torch.testing.assert_close(kernel(q, k, v, layout, True, 0.0), PER_DOCUMENT_SDPA(q, k, v, layout, True, 0.0),
                               rtol=0, atol=0)


# Stand-ins with the signatures of torch's varlen_attn (public torch/nn/attention/varlen.py): 2.13 takes window_size
# and enable_gqa (and refuses grouped k/v without it); 2.11 window_size only, with no head check (FlashAttention-2's
# varlen kernel reads grouped k/v as they are); an older one is_causal only. Each computes the contract.
def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    return _varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window_size,
                             enable_gqa=enable_gqa)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    return _varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window_size,
                             enable_gqa=key.shape[1] != query.shape[1])


def varlen_is_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return _varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                             window_size=(-1, 0) if is_causal else (-1, -1), enable_gqa=key.shape[1] != query.shape[1])


@pytest.mark.parametrize("varlen", [varlen_2_13, varlen_2_11, varlen_is_causal])
@pytest.mark.parametrize("causal", [True, False])
def test_each_varlen_signature_is_called_as_it_asks_and_matches_one_sdpa_call_per_document(varlen, causal):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, NH, S, D, generator=g).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(B, NKV, S, D, generator=g).to(torch.bfloat16).requires_grad_() for _ in "kv")
    layout = DocumentLayout.from_ids(torch.tensor(ROWS))
    kernel, reason = varlen_kernel(varlen)
    assert isinstance(kernel, VarlenDocuments)
    assert reason.endswith("grouped k/v heads reach it as they are)") == (varlen is not varlen_2_13)
    got = kernel(q, k, v, layout, causal, 0.0)
    got.float().sum().backward()  # the grouped k/v heads' gradients reach k and v (no NaN, their shapes)
    assert k.grad.shape == k.shape and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
    want = PER_DOCUMENT_SDPA(q.detach().float(), k.detach().float(), v.detach().float(), layout, causal, 0.0)
    torch.testing.assert_close(got.detach().float(), want, rtol=0,
                               atol=torch.finfo(torch.bfloat16).eps * want.abs().max().item())


def test_a_varlen_attn_of_unknown_signature_is_refused_with_its_signature():
    kernel, reason = varlen_kernel(lambda query, key, value, cu, cu_k, max_q, max_k, causal_window=None: None)
    assert kernel is None and "takes neither window_size nor is_causal" in reason and "causal_window" in reason


@pytest.mark.parametrize("head_dim", [12, 264])
def test_a_head_dim_flash_attention_2_refuses_takes_one_sdpa_call_per_document(head_dim):
    """FlashAttention-2 needs a head dim <= 256 and a multiple of 8."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(B, h, S, head_dim, generator=g).to(torch.bfloat16) for h in (NH, NKV, NKV))
    layout = DocumentLayout.from_ids(torch.tensor(ROWS))
    kernel = VarlenDocuments(lambda *args, **kwargs: pytest.fail(f"varlen_attn called at head dim {head_dim}"))
    torch.testing.assert_close(kernel(q, k, v, layout, True, 0.0), PER_DOCUMENT_SDPA(q, k, v, layout, True, 0.0),
                               rtol=0, atol=0)
