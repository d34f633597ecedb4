"""CUDA's kernel calls checked without a GPU: FakeTensorMode with CUDA tensors on this CPU-only torch runs torch's
meta kernels of the CUDA operators, so the shapes, dtypes and lse layout every call receives and returns are
asserted here; the numbers only on a GPU (scripts/gpu_check.sh). And which kernel each path chose, by device.

What does not work under fake CUDA tensors in a CPU-only torch 2.13 (docs/performance.md keeps the list):
autograd on them (a fake CUDA tensor that requires grad aborts the process in AccumulateGrad: no CUDA device
guard), so backwards are called directly; Python indexing and Tensor.copy_ (their bindings take a device guard:
"PyTorch is not linked with support for cuda devices"), so the ring's per-document pieces, which write with copy_,
are checked per operator call; torch.autocast("cuda") (disabled with a warning); and anything that reads values
(DocumentLayout.from_ids, the documents' block skipping), so layouts are built on CPU first.

What a test expects of varlen_attn (its operator's arguments, how grouped heads reach it) is read from the schema of
the operator the call reached, as the library reads the wrapper's signature; the varlen tests run twice, on the
installed torch and on torch 2.11's varlen_attn replayed by a stand-in (tests/varlen_2_11.py: the GPU image's torch).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import parallel_attention as pa
from parallel_attention.transformer.context_parallel import RingCoreAttention
from parallel_attention.transformer.kernels.flash_ops import CUDA_FLASH_OPS
from parallel_attention.transformer.context_parallel.ring_attention import BlockMasks, RingAttention, RingPlan
from parallel_attention.transformer.kernels.ring_blocks import (CPU_FLASH_BLOCKS, CUDA_FLASH_BLOCKS,
                                                                         MATH_BLOCKS, Pair)
from parallel_attention.transformer.kernels.core_attention import AutoAttention, CpuAttention, SdpaAttention
from parallel_attention.transformer.kernels.document_kernels import PerDocumentSdpa, VarlenDocuments
from parallel_attention.transformer.documents import DocumentLayout

import varlen_2_11

B, NH, NKV, M, D = 2, 8, 2, 48, 64
FLASH, FLASH_BACKWARD = "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"


class _Calls(TorchDispatchMode):
    """Every operator call with its tensor arguments and results, as (shape, dtype, device type, contiguous)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))

        def seen(values):
            return [(tuple(t.shape), t.dtype, t.device.type, t.is_contiguous()) if isinstance(t, torch.Tensor) else t
                    for t in values]

        results = result if isinstance(result, (tuple, list)) else (result,)
        self.calls.append((func.overloadpacket.__name__, seen(args), seen(results), kwargs or {}))
        return result

    def named(self, name):
        return [call for call in self.calls if call[0] == name]


def _spec(shape, dtype):
    """How _Calls records a contiguous CUDA tensor."""
    return (tuple(shape), dtype, "cuda", True)


def _causal(call) -> bool:
    """An aten operator call's is_causal argument, found by name in the installed operator's schema (the dispatcher
    drops arguments left at their default, False)."""
    return bool(_argument(call, getattr(torch.ops.aten, call[0]), "is_causal"))


def _fake_cuda(dtype, *shapes):
    return [torch.randn(*shape, device="cuda", dtype=dtype) for shape in shapes]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("diagonal", [False, True], ids=["full", "diagonal"])
def test_a_ring_pair_calls_the_cuda_flash_operator_with_grouped_heads_and_a_float32_lse(dtype, diagonal):
    tril = torch.ones(M, M, dtype=torch.bool).tril() if diagonal else None
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, grad_out = _fake_cuda(dtype, (B, NH, M, D), (B, NKV, M, D), (B, NKV, M, D), (B, NH, M, D))
        pair = Pair(0, 0, tril, (0, 0) if diagonal else (1, 0), diagonal)
        with _Calls() as ops:
            out, lse = CUDA_FLASH_BLOCKS.forward(q, k, v, pair, 1 / math.sqrt(D), None)
            grads = CUDA_FLASH_BLOCKS.backward(q, k, v, pair, 1 / math.sqrt(D), None, grad_out, out, lse, None)
    (forward,), (backward,) = ops.named(FLASH), ops.named(FLASH_BACKWARD)
    assert forward[1][:3] == [_spec((B, NH, M, D), dtype), _spec((B, NKV, M, D), dtype),
                              _spec((B, NKV, M, D), dtype)]  # k/v with their own heads
    assert _causal(forward) is diagonal and _causal(backward) is diagonal
    assert forward[2][1] == _spec((B, NH, M), torch.float32)  # the operator's own lse
    assert (out.shape, out.dtype) == ((B, NH, M, D), dtype)
    assert (lse.shape, lse.dtype, lse.is_contiguous()) == ((B, NH, M), torch.float32, True)
    assert _argument(backward, torch.ops.aten._scaled_dot_product_flash_attention_backward, "logsumexp") == _spec(
        (B, NH, M), torch.float32)  # the lse the backward receives
    assert backward[1][1][0] == (B, NH, M, D) and backward[1][2][0] == (B, NKV, M, D)
    assert [(tuple(g.shape), g.dtype) for g in grads] == [((B, NH, M, D), dtype), ((B, NKV, M, D), dtype),
                                                           ((B, NKV, M, D), dtype)]
    assert not ops.named("bmm") and not ops.named("_scaled_dot_product_flash_attention_for_cpu")


def test_a_document_piece_calls_the_operator_on_its_slices_and_causal_only_on_a_square():
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _fake_cuda(torch.bfloat16, (B, NH, M, D), (B, NKV, M, D), (B, NKV, M, D))
        rows = [t.narrow(0, 1, 1).narrow(2, start, length) for t, start, length in ((q, 5, 17), (k, 0, 30), (v, 0, 30))]
        out, lse = CUDA_FLASH_OPS.forward(*rows, False, 0.125)  # a fully visible piece: 17 queries, 30 keys
        assert (out.shape, lse.shape, lse.dtype, lse.is_contiguous()) == ((1, NH, 17, D), (1, NH, 17), torch.float32,
                                                                          True)
        with pytest.raises(AssertionError, match="17 x 30"):  # CUDA aligns it bottom-right, the CPU top-left
            CUDA_FLASH_OPS.forward(*rows, True, 0.125)


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 64), (torch.bfloat16, 12), (torch.bfloat16, 264)],
                         ids=["fp32", "d12", "d264"])
def test_what_the_cuda_flash_operator_refuses_runs_as_math(dtype, head_dim):
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _fake_cuda(dtype, (B, NH, M, head_dim), (B, NKV, M, head_dim), (B, NKV, M, head_dim))
        with _Calls() as ops:
            out, lse = CUDA_FLASH_BLOCKS.forward(q, k, v, Pair(0, 0, None, (1, 0), False), 0.1, lambda t: t)
    assert not ops.named(FLASH) and ops.named("bmm")  # the math: explicit q k^T and p v
    assert (out.shape, lse.dtype) == ((B, NH, M, head_dim), torch.float32)


class _Context:
    """What RingAttention's forward and backward use of autograd's ctx (autograd itself cannot run here)."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def test_the_ring_runs_forward_and_backward_through_the_cuda_operators():
    """A ring of one rank (cp chunks 0 and 1, causal): 2 diagonal pairs and 1 full pair, each one operator call
    forward and one backward; the merge and the gradient sums in float32, cast to bf16 once at the end."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, grad_out = _fake_cuda(torch.bfloat16, (B, NH, 2 * M, D), (B, NKV, 2 * M, D), (B, NKV, 2 * M, D),
                                       (B, NH, 2 * M, D))
        plan, ctx = RingPlan(None, BlockMasks(M, True, device="cuda"), NH // NKV, blocks=CUDA_FLASH_BLOCKS), _Context()
        with _Calls() as ops:
            out = RingAttention.forward(ctx, q, k, v, plan)
            ctx.plan = plan
            dq, dk, dv, _ = RingAttention.backward(ctx, grad_out)
    assert [_causal(call) for call in ops.named(FLASH)] == [True, False, True]  # is_causal: the diagonals only
    assert [_causal(call) for call in ops.named(FLASH_BACKWARD)] == [True, False, True]
    assert all(_argument(call, torch.ops.aten._scaled_dot_product_flash_attention_backward, "logsumexp") == _spec(
        (B, NH, M), torch.float32) for call in ops.named(FLASH_BACKWARD))
    assert ctx.saved_tensors[4].dtype == torch.float32  # the merged lse kept for backward
    assert (out.shape, out.dtype) == ((B, NH, 2 * M, D), torch.bfloat16)
    assert [(tuple(g.shape), g.dtype) for g in (dq, dk, dv)] == [
        ((B, NH, 2 * M, D), torch.bfloat16), ((B, NKV, 2 * M, D), torch.bfloat16), ((B, NKV, 2 * M, D), torch.bfloat16)]


def _on_cuda(t: torch.Tensor) -> torch.Tensor:
    """A fake CUDA tensor of a real CPU one's shape and dtype (its values: no fake kernel reads them, and a copy to
    a fake CUDA device fails as Tensor.copy_ does)."""
    return torch.empty(t.shape, dtype=t.dtype, device="cuda")


@pytest.fixture(params=["installed", "torch 2.11"])
def varlen_ops(request, monkeypatch):
    """(forward, backward) operators of the varlen_attn the library will call: the installed torch's, or torch
    2.11's replayed (its wrapper put where the library looks)."""
    if request.param == "installed":
        import torch.nn.attention.varlen  # noqa: F401  (registers its operators)

        return torch.ops.torch_attn._varlen_attn, torch.ops.torch_attn._varlen_attn_backward
    varlen_2_11.install(monkeypatch)
    return varlen_2_11.FORWARD, varlen_2_11.BACKWARD


def _argument_names(op) -> list[str]:
    return [argument.name for argument in op.default._schema.arguments]


def _argument(call, op, name: str):
    """The value an operator call passed for argument `name` (positional or keyword), None when left out."""
    index = _argument_names(op).index(name)
    return call[3].get(name, call[1][index] if len(call[1]) > index else None)


def _by_schema(op, **values) -> list:
    """`values` as the operator's positional arguments, in its schema's order; names it lacks are left out (2.11's
    forward has no enable_gqa) and so are the defaults after the last one given."""
    names = [name for name in _argument_names(op) if name in values]
    return [values[name] for name in names]


@pytest.mark.parametrize("causal", [True, False])
def test_packed_documents_on_cuda_are_one_varlen_call_with_grouped_k_v_as_they_are(causal, varlen_ops):
    s = 40
    # odd lengths, single tokens; built on CPU (its spans need values), its cu_seqlens then on the fake device
    layout = DocumentLayout.from_ids(torch.tensor([[0] * 7 + [1] + [2] * 31 + [3], [0] * 40]))
    with FakeTensorMode(allow_non_fake_inputs=True):
        kernel, documents = SdpaAttention("cuda"), dataclasses.replace(layout, cu_seqlens=_on_cuda(layout.cu_seqlens))
        q, k, v = _fake_cuda(torch.bfloat16, (B, NH, s, D), (B, NKV, s, D), (B, NKV, s, D))
        with _Calls() as ops:
            out = kernel(q, k, v, None, causal, 0.0, documents)
    (call,) = ops.named("_varlen_attn")
    forward = varlen_ops[0]
    args, results = call[1], call[2]
    assert args[:4] == [_spec((B * s, NH, D), torch.bfloat16), _spec((B * s, NKV, D), torch.bfloat16),
                        _spec((B * s, NKV, D), torch.bfloat16), _spec((6,), torch.int32)]  # 5 documents in the batch
    assert args[5:7] == [40, 40] and layout.cu_seqlens.tolist() == [0, 7, 8, 39, 40, 80]  # the longest: row 1
    assert list(_argument(call, forward, "window_size")) == ([-1, 0] if causal else [-1, -1])
    if "enable_gqa" in _argument_names(forward):  # grouped k/v need it where the wrapper checks the heads (2.13)
        assert _argument(call, forward, "enable_gqa") is True
    assert results[0] == _spec((B * s, NH, D), torch.bfloat16) and results[1][1] == torch.float32
    assert (out.shape, out.dtype) == ((B, NH, s, D), torch.bfloat16)
    assert not ops.named("scaled_dot_product_attention") and not ops.named("_scaled_dot_product_flash_attention")
    assert not ops.named("repeat_interleave") and not ops.named("index_select")  # no copies of k and v per head


def test_varlen_attn_has_a_backward_for_grouped_heads_under_fake_tensors(varlen_ops):
    """What autograd calls on a GPU (torch's registered backward of varlen_attn): its meta contract, each operator
    called with the arguments its schema names."""
    forward, backward = varlen_ops
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _fake_cuda(torch.bfloat16, (80, NH, D), (80, NKV, D), (80, NKV, D))
        cu = _on_cuda(torch.tensor([0, 7, 8, 39, 40, 80], dtype=torch.int32))
        common = dict(query=q, key=k, value=v, cu_seq_q=cu, cu_seq_k=cu, max_q=31, max_k=31, is_causal=True,
                      scale=None, window_size=[-1, 0])
        out, lse, rng = forward(*_by_schema(forward, **common, enable_gqa=True))
        grads = backward(*_by_schema(backward, grad_out=out, out=out, lse=lse, rng_state=rng, **common))
    assert (out.shape, lse.dtype) == ((80, NH, D), torch.float32)
    assert [tuple(g.shape) for g in grads] == [(80, NH, D), (80, NKV, D), (80, NKV, D)]


def test_each_path_chooses_its_kernel_by_device_once():
    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda, cuda_sdpa = AutoAttention("cuda"), SdpaAttention("cuda")
        cuda_dropout = AutoAttention("cuda", dropout=True)
        ring = RingCoreAttention(None, 1, device="cuda")
    assert type(cuda.kernel) is SdpaAttention and type(cuda.kernel.documents_kernel) is VarlenDocuments
    assert type(cuda_sdpa.documents_kernel) is VarlenDocuments
    assert type(cuda_dropout.kernel.documents_kernel) is PerDocumentSdpa
    assert "dropout" in cuda_dropout.kernel.documents_reason
    assert ring.blocks is CUDA_FLASH_BLOCKS and RingCoreAttention(None, 1).blocks is CPU_FLASH_BLOCKS
    cpu = AutoAttention("cpu")
    assert type(cpu.kernel) is CpuAttention and type(cpu.kernel.documents_kernel) is PerDocumentSdpa
    assert "CUDA only" in cpu.kernel.documents_reason
    assert RingCoreAttention(None, 1).to("meta").blocks is MATH_BLOCKS  # no operator row for meta
    paths = pa.active_paths()
    assert paths["ring pairs on CUDA (context_parallel_kind='ring')"].startswith(
        "aten._scaled_dot_product_flash_attention for")
    assert paths["ring pairs on CPU (context_parallel_kind='ring')"].startswith(
        "aten._scaled_dot_product_flash_attention_for_cpu for")
    assert "varlen_attn" in paths["packed documents on CUDA (attention_kernel='auto'/'sdpa', no attention_mask)"]


def test_without_varlen_attn_cuda_keeps_one_sdpa_call_per_document_and_says_why(monkeypatch):
    import importlib.util

    from parallel_attention.transformer.kernels import document_kernels

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == document_kernels.VARLEN_MODULE
                        else find_spec(name, *args))
    with FakeTensorMode(allow_non_fake_inputs=True):
        kernel = SdpaAttention("cuda")
    assert type(kernel.documents_kernel) is PerDocumentSdpa
    assert kernel.documents_reason.endswith("has no torch.nn.attention.varlen (torch >= 2.10 has)")
    assert "has no torch.nn.attention.varlen" in pa.active_paths()[
        "packed documents on CUDA (attention_kernel='auto'/'sdpa', no attention_mask)"]


def test_torch_2_11s_varlen_attn_is_called_without_enable_gqa_and_active_paths_says_so(monkeypatch):
    """torch 2.11's varlen_attn takes window_size but no enable_gqa (read by signature) and checks no head counts:
    grouped k/v heads reach it as they are (gpu_check's probe step compares them with the repeated call)."""
    varlen_2_11.install(monkeypatch)
    layout = DocumentLayout.from_ids(torch.tensor([[0] * 7 + [1] + [2] * 32, [0] * 40]))
    with FakeTensorMode(allow_non_fake_inputs=True):
        kernel, documents = SdpaAttention("cuda"), dataclasses.replace(layout, cu_seqlens=_on_cuda(layout.cu_seqlens))
        q, k, v = _fake_cuda(torch.bfloat16, (B, NH, 40, D), (B, NKV, 40, D), (B, NKV, 40, D))
        with _Calls() as ops:
            out = kernel(q, k, v, None, True, 0.0, documents)
    assert type(kernel.documents_kernel) is VarlenDocuments and "takes no enable_gqa" in kernel.documents_reason
    (call,) = ops.named("_varlen_attn")
    assert [spec[0] for spec in call[1][:3]] == [(B * 40, NH, D), (B * 40, NKV, D), (B * 40, NKV, D)]
    assert len(call[1]) + len(call[3]) == len(_argument_names(varlen_2_11.FORWARD)) == 10
    assert out.shape == (B, NH, 40, D)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # active_paths reads the signature where CUDA is
    assert "takes no enable_gqa" in pa.active_paths()[
        "packed documents on CUDA (attention_kernel='auto'/'sdpa', no attention_mask)"]


def test_the_cuda_flash_operators_are_read_by_schema_and_another_schema_runs_the_rings_math(monkeypatch):
    from types import SimpleNamespace

    from parallel_attention.transformer.kernels.flash_ops import CUDA_ARGUMENTS, schema_problem

    def namespace(arguments):  # stand-ins for torch.ops.aten's operators, with these argument names
        return SimpleNamespace(**{name: SimpleNamespace(default=SimpleNamespace(_schema=SimpleNamespace(
            arguments=[SimpleNamespace(name=a) for a in args]))) for name, args in arguments.items()})

    assert CUDA_FLASH_OPS.problem is None and schema_problem(CUDA_ARGUMENTS, namespace(CUDA_ARGUMENTS)) is None
    backward = "_scaled_dot_product_flash_attention_backward"
    renamed = {**CUDA_ARGUMENTS, backward: CUDA_ARGUMENTS[backward][:-1] + ("softmax_scale",)}
    problem = schema_problem(CUDA_ARGUMENTS, namespace(renamed))
    assert problem.startswith(f"this torch's aten.{backward} takes (grad_out, ") and "softmax_scale), not (" in problem
    assert schema_problem(CUDA_ARGUMENTS, SimpleNamespace()) == (
        "this torch has no aten._scaled_dot_product_flash_attention")
    q = torch.empty(1, 2, 8, 64, dtype=torch.bfloat16)
    assert CUDA_FLASH_OPS.takes(q) and not CUDA_FLASH_OPS._replace(problem=problem).takes(q)
    monkeypatch.setattr(CUDA_FLASH_BLOCKS, "ops", CUDA_FLASH_OPS._replace(problem=problem))
    assert pa.active_paths()["ring pairs on CUDA (context_parallel_kind='ring')"] == f"explicit-lse math ({problem})"
