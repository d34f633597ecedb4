"""Causal attention in chunks of query rows (transformer/kernels/causal_chunks.py): the values and gradients of an
explicit causal softmax(q k^T / sqrt(d)) v written here, MHA and GQA, sequence lengths that are and are not
multiples of the chunk; when the chunks apply; and that the CPU kernel (attention_kernel='auto' on CPU) takes
them, chosen at construction and again when the module moves."""

from __future__ import annotations

import math

import pytest
import torch

from parallel_attention.training.activation_memory import saved_activation_bytes
from parallel_attention.transformer.kernels import causal_chunks
from parallel_attention.transformer.kernels.core_attention import AutoAttention, CpuAttention, SdpaAttention


def _explicit_causal(q, k, v):
    """q [b, nh, s, d], k and v [b, nkv, s, d]: every query head against its group's k/v head."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(dim=-1) @ v


def _inputs(heads, kv_heads, s, dtype, seed=0):
    """q, k, v as the attention module hands them over: views of one batch-major fused buffer."""
    torch.manual_seed(seed)
    b, d = 2, 16
    fused = torch.randn(b, s, (heads + 2 * kv_heads) * d, dtype=dtype, requires_grad=True)
    parts = fused.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in parts)
    return fused, q, k, v


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("s", [128, 200, 512])  # 200: a last chunk of 8 rows
def test_values_and_gradients_equal_explicit_attention_in_float64(heads, kv_heads, s):
    fused, q, k, v = _inputs(heads, kv_heads, s, torch.float64)
    assert causal_chunks.applies(q, k, v, 0.0)
    grad = torch.randn(2, heads, s, 16, dtype=torch.float64)
    ours = causal_chunks.chunked_causal_attention(q, k, v)
    (ours_grad,) = torch.autograd.grad(ours, fused, grad)
    explicit = _explicit_causal(q, k, v)
    (explicit_grad,) = torch.autograd.grad(explicit, fused, grad)
    # float64: both sum the same terms in other orders; 1e-12 is ~1e4 ulps of the O(1) values
    torch.testing.assert_close(ours, explicit, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours_grad, explicit_grad, rtol=0, atol=1e-12)


def test_float32_matches_the_single_kernel_call_and_its_layout():
    fused, q, k, v = _inputs(8, 2, 512, torch.float32)
    grad = torch.randn(2, 8, 512, 16)
    ours = causal_chunks.chunked_causal_attention(q, k, v)
    (ours_grad,) = torch.autograd.grad(ours, fused, grad)
    single = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (single_grad,) = torch.autograd.grad(single, fused, grad)
    # float32, softmax over up to 512 keys in other blocks: a few ulps of values of order 1
    torch.testing.assert_close(ours, single, rtol=0, atol=2e-6)
    torch.testing.assert_close(ours_grad, single_grad, rtol=0, atol=2e-5)
    assert ours.stride() == single.stride()  # [b, s, nh, d] in memory: the context reshape stays a view


def test_keeps_for_backward_what_the_single_call_keeps():
    fused, q, k, v = _inputs(8, 2, 320, torch.float32)
    chunked = saved_activation_bytes(lambda: causal_chunks.chunked_causal_attention(q, k, v))
    single = saved_activation_bytes(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True))
    # the fused q|k|v buffer, the [b, s, nh, d] output and float32 log-sum-exp rows [b, nh, s]
    assert chunked == single == fused.numel() * 4 + 2 * 320 * 8 * 16 * 4 + 2 * 8 * 320 * 4


def test_applies_only_where_it_pays():
    _, q, k, v = _inputs(4, 4, 256, torch.float32)
    assert causal_chunks.applies(q, k, v, 0.0)
    assert not causal_chunks.applies(q, k, v, 0.1)  # the kernel's own dropout draws per call
    assert not causal_chunks.applies(q[:, :, :100], k, k, 0.0)  # not self-attention
    _, short_q, short_k, _ = _inputs(4, 4, 2 * causal_chunks.CHUNK_ROWS - 1, torch.float32)
    assert not causal_chunks.applies(short_q, short_k, short_k, 0.0)  # one chunk: nothing to skip
    _, long_q, long_k, _ = _inputs(1, 1, causal_chunks.MAX_KEYS + 1, torch.float32)
    assert not causal_chunks.applies(long_q, long_k, long_k, 0.0)  # the kernel skips masked key blocks itself
    assert not causal_chunks.applies(q.to(torch.int32), k, v, 0.0)  # no flash kernel for it
    assert not causal_chunks.applies(q.double(), k, v, 0.0)  # mixed dtypes
    _, q6, k4, v4 = _inputs(6, 4, 256, torch.float32)
    assert not causal_chunks.applies(q6, k4, v4, 0.0)  # 6 query heads cannot share 4 k/v heads evenly
    assert not causal_chunks.applies(q, k, k.transpose(2, 3).contiguous().transpose(2, 3), 0.0)


def test_the_kernel_keeps_batch_major_copies_of_strided_inputs():
    """q, k, v come as [b, heads, s, d] views of the [s, b, ...] projection output; the kernel reads (and keeps for
    backward) copies laid out [b, s, heads, d], each sample's rows contiguous."""
    torch.manual_seed(0)
    fused = torch.randn(192, 2, (4 + 2 * 2) * 16, requires_grad=True)  # [s, b, (nh + 2 nkv) d]
    q, k, v = (t.view(192, 2, -1, 16).permute(1, 2, 0, 3) for t in fused.split([64, 32, 32], dim=-1))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        causal_chunks.chunked_causal_attention(q, k, v)
    for t in saved[:3]:
        assert t.stride(0) > t.stride(2) > t.stride(1) > t.stride(3) == 1, t.stride()


def test_the_cpu_kernel_is_chosen_by_device_once_and_again_on_a_move():
    auto = AutoAttention("cpu")
    assert type(auto.kernel) is CpuAttention
    auto.to("meta")  # any other device: SDPA, one call (a CUDA move takes the same path)
    assert type(auto.kernel) is SdpaAttention
    auto.to_empty(device="cpu")
    assert type(auto.kernel) is CpuAttention
    assert list(auto.buffers()) == [] and auto.state_dict() == {}  # no state: nothing to save or synchronise


def test_the_cpu_kernel_takes_the_chunks_for_causal_attention_only(monkeypatch):
    calls = []
    original = causal_chunks.chunked_causal_attention
    monkeypatch.setattr(causal_chunks, "chunked_causal_attention", lambda *a: calls.append(1) or original(*a))
    _, q, k, v = _inputs(4, 2, 192, torch.float32)
    cpu = CpuAttention()
    chunked = cpu(q, k, v, None, True, 0.0)
    single = SdpaAttention()(q, k, v, None, True, 0.0)  # attention_kernel='sdpa': one call
    cpu(q, k, v, None, False, 0.0)  # not causal
    cpu(q, k, v, torch.ones(1, 1, 192, 192, dtype=torch.bool), True, 0.0)  # a mask of the caller's
    assert len(calls) == 1
    torch.testing.assert_close(chunked, single, rtol=0, atol=2e-6)
