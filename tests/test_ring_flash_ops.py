"""The ring's pair kernel in half precision through torch's fused CPU operator (transformer/kernels/flash_ops.py): one
implementation, FlashBlocks, whose CPU and CUDA rows differ only in the operators they call.

Inputs are drawn in float32 and rounded to the half dtype once; the reference is MathBlocks in float32 on the very
same (rounded) values, so what the comparison sees is the kernel's own rounding: its outputs and gradients are
rounded to the half dtype, each within one ulp of the largest reference value (eps x max |ref|: bf16 eps 2^-7,
fp16 2^-10; measured <= 0.4 of that). The lse is float32 either way (scores summed in float32 from half products:
within 1e-3, measured <= 7e-5).
"""

from __future__ import annotations

import math

import pytest
import torch

from parallel_attention.transformer.context_parallel.ring_attention import BlockMasks
from parallel_attention.transformer.kernels.ring_blocks import CPU_FLASH_BLOCKS, MATH_BLOCKS, Pair
from parallel_attention.transformer.documents import DocumentLayout

B, NH, NKV, M, D = 2, 4, 2, 24, 16


def _identity(t):
    return t


class _RecordFused(torch.utils._python_dispatch.TorchDispatchMode):
    """The shapes of the k argument of every fused CPU flash call (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.key_heads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
            self.key_heads.append(args[2 if name.endswith("backward") else 1].shape[1])
        return func(*args, **(kwargs or {}))


def _pair(kind):
    tril = torch.ones(M, M, dtype=torch.bool).tril()
    if kind == "full":
        return Pair(0, 0, None, (1, 0), False)
    if kind == "diagonal":
        return Pair(0, 0, tril, (0, 0), True)
    ids = torch.tensor([[0] * 5 + [1] + [2] * 18, [0] * 11 + [1] * 13])  # odd lengths, a single token
    masks = BlockMasks(M, True, DocumentLayout.from_ids(ids))
    _, mask, pieces = masks.pair(0, 0)
    return Pair(0, 0, mask, (0, 0), False, pieces)


def _within_an_ulp_of_the_largest(got, want, dtype):
    torch.testing.assert_close(got.float(), want, rtol=0, atol=torch.finfo(dtype).eps * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["full", "diagonal", "documents"])
def test_a_half_precision_pair_runs_the_fused_operator_with_grouped_heads_and_a_float32_lse(dtype, kind):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, NH, M, D, generator=g).to(dtype)
    k, v = (torch.randn(B, NKV, M, D, generator=g).to(dtype) for _ in "kv")
    grad_out = torch.randn(B, NH, M, D, generator=g).to(dtype)
    pair, scale = _pair(kind), 1.0 / math.sqrt(D)
    want, want_lse = MATH_BLOCKS.forward(q.float(), k.float(), v.float(), pair, scale, _identity)
    with _RecordFused() as fused:
        out, lse = CPU_FLASH_BLOCKS.forward(q, k, v, pair, scale, _identity)
        delta = (grad_out.float() * out.float()).sum(-1)
        grads = CPU_FLASH_BLOCKS.backward(q, k, v, pair, scale, _identity, grad_out, out, lse, delta)
    wants = MATH_BLOCKS.backward(q.float(), k.float(), v.float(), pair, scale, _identity, grad_out.float(),
                                 out.float(), lse, delta)
    calls = 2 * len(pair.pieces) if pair.pieces else 2
    assert fused.key_heads == [NKV] * calls  # the operator takes grouped k/v: never expanded for it
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (B, NH, M) and lse.is_contiguous()
    _within_an_ulp_of_the_largest(out, want, dtype)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-3)
    assert [tuple(t.shape) for t in grads] == [(B, NH, M, D), (B, NKV, M, D), (B, NKV, M, D)]
    for got, ref in zip(grads, wants):
        _within_an_ulp_of_the_largest(got, ref, dtype)


def _ring_worker(dtype, documents):
    import parallel_attention as pa
    from parallel_attention.transformer.context_parallel import split_for_context_parallel
    from parallel_attention.transformer.context_parallel.ring_attention import RingAttention, RingPlan

    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1, context_parallel_size=2)
    group, s = pa.get_context_parallel_group(), 4 * M
    layout = DocumentLayout.from_ids(torch.tensor([[0] * 30 + [1] + [2] * 65] * B)) if documents else None
    g = torch.Generator().manual_seed(7)  # the same full q, k, v on every rank
    full = [torch.randn(B, heads, s, D, generator=g).to(dtype) for heads in (NH, NKV, NKV)]
    grad_out = torch.randn(B, NH, s, D, generator=g).to(dtype)
    results = []
    for run_dtype, blocks in ((dtype, CPU_FLASH_BLOCKS), (torch.float32, MATH_BLOCKS)):
        local = [split_for_context_parallel(t.to(run_dtype), group, 2).requires_grad_() for t in full]
        plan = RingPlan(group, BlockMasks(s // 4, True, layout), NH // NKV, blocks=blocks)
        out = RingAttention.apply(*local, plan)
        out.backward(split_for_context_parallel(grad_out.to(run_dtype), group, 2))
        results.append([out.detach()] + [t.grad for t in local])
    return results


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_the_ring_in_bf16_through_the_cpu_operator_matches_its_float32_math(documents):
    """cp 2, GQA: the whole ring (merge by lse and gradients summed around it in float32, cast once at the end)
    against the float32 ring of MathBlocks on the same rounded inputs."""
    from distributed import run_distributed

    for half, reference in run_distributed(_ring_worker, 2, 1, torch.bfloat16, documents):
        for got, want in zip(half, reference):
            assert got.dtype == torch.bfloat16
            _within_an_ulp_of_the_largest(got, want, torch.bfloat16)
