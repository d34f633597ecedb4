"""The ring's per-pair kernels (transformer/kernels/ring_blocks.py): torch's fused CPU flash kernel, which returns the
log-sum-exp, against the explicit-lse math for one block pair, forward and backward from the final output and lse;
and which kernel the ring's module chooses (by device, once, again when it moves).

float64, one process: the two kernels sum in other orders (the flash kernel in tiles), hence 1e-12; autograd on the
plain softmax attention of the pair is the reference for both.

A pair partly masked by packed documents runs the fused kernel once per document sub-pair (counted by a dispatch
mode): per pair, and through the whole ring at cp 2 and 4 (float64, 1e-10 against the masked softmax reference),
with no host sync in the step and no per-pair mask built for the fused pieces (only the math builds its masks).
"""

from __future__ import annotations

import math

import pytest
import torch

from parallel_attention.transformer.context_parallel import RingCoreAttention
from parallel_attention.transformer.kernels.ring_blocks import (CPU_FLASH_BLOCKS, MATH_BLOCKS, CpuFlashBlocks,
                                                                         MathBlocks, Pair)
from parallel_attention.transformer.context_parallel.ring_dropout import RingDropoutSpec

B, NH, M, D = 2, 3, 20, 7  # awkward sizes: m not a multiple of the kernel's tiles
TOL = dict(rtol=1e-12, atol=1e-12)


def _identity(t):
    return t


def _pair(kind):
    if kind == "full":
        return Pair(0, 0, None, (1, 0), False)
    tril = torch.ones(M, M, dtype=torch.bool).tril()
    if kind == "diagonal":
        return Pair(0, 0, tril, (0, 0), True)
    mask = torch.rand(B, 1, M, M, generator=torch.Generator().manual_seed(5)) > 0.3  # a documents-like mask
    return Pair(0, 0, mask | torch.eye(M, dtype=torch.bool), (1, 1), False)


@pytest.mark.parametrize("blocks", [MathBlocks(), CpuFlashBlocks()], ids=["math", "cpu_flash"])
@pytest.mark.parametrize("kind", ["full", "diagonal", "masked"])
def test_a_pair_kernel_gives_softmax_attention_and_its_gradients(blocks, kind):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, NH, M, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(B, NH, M, D, generator=g, dtype=torch.float64)
    pair, scale = _pair(kind), 1.0 / math.sqrt(D)
    scores = q @ k.transpose(-1, -2) * scale
    if pair.mask is not None:
        scores = scores.masked_fill(~pair.mask, float("-inf"))
    want = torch.softmax(scores, -1) @ v
    want.backward(grad_out)
    with torch.no_grad():
        out, lse = blocks.forward(q, k, v, pair, scale, _identity)
        torch.testing.assert_close(out, want, **TOL)
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1), **TOL)
        delta = (grad_out * out).sum(-1)
        grads = blocks.backward(q, k, v, pair, scale, _identity, grad_out, out, lse, delta)
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad, **TOL)


def test_the_ring_chooses_its_pair_kernel_by_device_once():
    dropout = RingDropoutSpec(0.1, num_heads=4, head_offset=0, layer=0)
    assert RingCoreAttention(None, 1).blocks is CPU_FLASH_BLOCKS
    assert RingCoreAttention(None, 1, kernel="math").blocks is MATH_BLOCKS
    assert RingCoreAttention(None, 1, dropout).blocks is MATH_BLOCKS  # hashed masks need explicit probabilities
    moved = RingCoreAttention(None, 1).to("meta")  # any device but the CPU: the math (CUDA's flash is not wired)
    assert moved.blocks is MATH_BLOCKS and moved.to_empty(device="cpu").blocks is CPU_FLASH_BLOCKS


# packed documents over s = 2 cp m = 40 (cp 2: m 10; cp 4: m 5): odd lengths crossing chunk boundaries, single
# tokens, and (row 1) one document spanning every pair; rows differ, so pieces run row by row
DOCUMENT_ROWS = {"odd": [0] * 7 + [1] + [2] * 13 + [3] + [4] * 9 + [5] * 9, "single": list(range(40)),
                 "whole": [0] * 40}


def _documents(kinds):
    from parallel_attention.transformer.documents import DocumentLayout

    return DocumentLayout.from_ids(torch.tensor([DOCUMENT_ROWS[k] for k in kinds]))


class _CountFused(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the fused CPU flash kernel's forward and backward calls."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__.startswith("_scaled_dot_product_flash_attention_for_cpu"):
            self.calls += 1
        return func(*args, **(kwargs or {}))


class _HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts what would make a CUDA host wait for the device (reading a value: item, bool, int; an op whose output
    shape depends on values) and the bool [..., m, m] masks built."""

    SYNCS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2")

    def __init__(self, m: int):
        super().__init__()
        self.m, self.syncs, self.masks = m, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.syncs += func.overloadpacket.__name__ in self.SYNCS
        self.masks += (isinstance(out, torch.Tensor) and out.dtype == torch.bool and out.dim() >= 2
                       and tuple(out.shape[-2:]) == (self.m, self.m))
        return out


def _masked_softmax(q, k, v, mask, scale):
    """The reference: softmax attention with rows that see nothing giving 0 (and lse -inf)."""
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.exp(scores - torch.where(torch.isinf(lse), 0, lse).unsqueeze(-1)) @ v, lse


@pytest.mark.parametrize("kinds", [("odd", "whole"), ("single", "odd"), ("whole", "whole")])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("m", [10, 5])
def test_a_documents_masked_pair_runs_one_fused_call_per_document_and_equals_the_math(kinds, causal, m):
    from parallel_attention.transformer.context_parallel.ring_attention import BlockMasks

    masks, scale, g = BlockMasks(m, causal, _documents(kinds)), 1.0 / math.sqrt(D), torch.Generator().manual_seed(3)
    for q_chunk in range(40 // m):
        for k_chunk in range(40 // m):
            runs, mask, pieces = masks.pair(q_chunk, k_chunk)
            if not runs:
                continue
            pair = Pair(0, 0, mask, (q_chunk, k_chunk), False, pieces)
            q, k, v = (torch.randn(2, NH, m, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in "qkv")
            grad_out = torch.randn(2, NH, m, D, generator=g, dtype=torch.float64)
            want, want_lse = _masked_softmax(q, k, v, mask, scale)
            want.backward(grad_out)
            with torch.no_grad(), _CountFused() as fused:
                out, lse = CPU_FLASH_BLOCKS.forward(q, k, v, pair, scale, _identity)
                grads = CPU_FLASH_BLOCKS.backward(q, k, v, pair, scale, _identity, grad_out, out, lse,
                                                  (grad_out * out).sum(-1))
            assert fused.calls == 2 * len(pieces) > 0, (q_chunk, k_chunk, pieces)  # never the math
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
            for got, t in zip(grads, (q, k, v)):
                torch.testing.assert_close(got, t.grad, rtol=1e-10, atol=1e-10)


def _ring_worker(cp, causal, kinds):
    import parallel_attention as pa
    from parallel_attention.transformer.context_parallel import split_for_context_parallel
    from parallel_attention.transformer.context_parallel.ring_attention import BlockMasks, RingAttention, RingPlan

    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1, context_parallel_size=cp)
    group, documents = pa.get_context_parallel_group(), _documents(kinds)
    g = torch.Generator().manual_seed(7)  # the same full q, k, v on every rank
    q = torch.randn(2, 4, 40, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 40, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
    grad_out = torch.randn(2, 4, 40, D, generator=g, dtype=torch.float64)
    index = torch.arange(40)
    want, _ = _masked_softmax(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                              documents.mask(index, index, causal), 1.0 / math.sqrt(D))
    want.backward(grad_out)
    results = []
    for blocks in (CPU_FLASH_BLOCKS, MATH_BLOCKS):
        local = [split_for_context_parallel(t.detach(), group, 2).requires_grad_() for t in (q, k, v)]
        plan = RingPlan(group, BlockMasks(40 // (2 * cp), causal, documents), 2, blocks=blocks)
        with _CountFused() as fused, _HostSyncs(40 // (2 * cp)) as watched:
            out = RingAttention.apply(*local, plan)
            out.backward(split_for_context_parallel(grad_out, group, 2))
        for got, ref in zip([out] + [t.grad for t in local], (want, q.grad, k.grad, v.grad)):
            torch.testing.assert_close(got, split_for_context_parallel(ref.detach(), group, 2), rtol=1e-10, atol=1e-10)
        results.append((fused.calls, watched.syncs, watched.masks))
    return results, plan.computed_pairs()


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_the_ring_with_documents_equals_the_reference_through_the_fused_kernel(cp, causal):
    from distributed import run_distributed

    for kinds in (("odd", "whole"), ("single", "single")):
        for (flash, math), pairs in run_distributed(_ring_worker, 4, 4, cp, causal, kinds, timeout=240):
            (fused, syncs, masks), (math_calls, math_syncs, math_masks) = flash, math
            assert math_calls == 0 and fused >= 2 * pairs > 0, (fused, pairs)
            # no host sync in the step; the fused pieces build no per-pair mask, the math one per pair it runs
            assert syncs == math_syncs == 0 and masks == 0 and math_masks > 0, (flash, math)


@pytest.mark.parametrize("blocks", [CPU_FLASH_BLOCKS, MATH_BLOCKS], ids=["flash", "math"])
def test_the_causal_ring_keeps_no_mask_and_builds_one_only_for_the_math(blocks):
    """One rank (cp 1: the pairs (0, 0) and (1, 1) are causal diagonals): the plan holds no tensor, the fused
    operator needs no mask, the math builds the m x m ones it reads (per diagonal pair, forward and backward)."""
    from parallel_attention.transformer.context_parallel.ring_attention import BlockMasks, RingAttention, RingPlan

    plan = RingPlan(None, BlockMasks(M, True), 1, blocks=blocks)
    q, k, v = (torch.randn(B, NH, 2 * M, D, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    with _HostSyncs(M) as watched:
        RingAttention.apply(q, k, v, plan).sum().backward()
    assert not any(isinstance(value, torch.Tensor) for value in vars(plan.masks).values())
    assert watched.syncs == 0 and (watched.masks == 0) == (blocks is CPU_FLASH_BLOCKS), watched.masks
