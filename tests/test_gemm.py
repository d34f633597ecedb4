"""The linears' GEMMs (tensor_parallel/gemm.py): torch's by default; with PARALLEL_ATTENTION_ONEDNN_LINEAR=1 the
forward and the input gradient through oneDNN's inner product on float32 CPU tensors, agreeing with F.linear and
dY W, row by row independent of the batch, differentiable at p = 1; torch's GEMM wherever it does not apply or is
not asked for; scripts/benchmark_gemm.py times every form."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from parallel_attention.tensor_parallel import gemm
from parallel_attention.transformer.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_


@pytest.fixture
def onednn(monkeypatch):
    """oneDNN switched on for the test (PARALLEL_ATTENTION_ONEDNN_LINEAR=1), and off again after it."""
    if not gemm.onednn_available():
        pytest.skip("oneDNN's linear is not available")
    monkeypatch.setenv("PARALLEL_ATTENTION_ONEDNN_LINEAR", "1")
    gemm.onednn_linear_active.cache_clear()
    yield
    gemm.onednn_linear_active.cache_clear()


def _operands(dtype=torch.float32):
    torch.manual_seed(0)  # awkward sizes: a swapped or mis-sliced dimension cannot pass
    return torch.randn(37, 3, 29, dtype=dtype), torch.randn(23, 29, dtype=dtype), torch.randn(23, dtype=dtype)


def test_float32_cpu_runs_onednn_and_agrees_with_f_linear(onednn):
    x, w, b = _operands()
    y = gemm.linear(x, w, b)
    assert torch.equal(y, torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""))
    # another GEMM sums the 29 products in another order: float32 rounding, relative to the largest output
    assert ((y - F.linear(x, w, b)).abs().max() / y.abs().max()).item() < 1e-6
    dx = gemm.input_grad(y, w)  # dY W: the same inner product with W^T
    assert torch.equal(dx, torch.ops.mkldnn._linear_pointwise(y, w.t(), None, "none", [], ""))
    assert ((dx - y.matmul(w)).abs().max() / dx.abs().max()).item() < 1e-6


def test_rows_do_not_depend_on_the_other_rows(onednn):
    """A sequence or batch split (sequence parallelism, data parallelism) computes the same rows bit for bit,
    forward and for the input gradient."""
    x, w, b = _operands()
    full = gemm.linear(x, w, b)
    assert torch.equal(gemm.linear(x[:5], w, b), full[:5])
    assert torch.equal(gemm.linear(x[:, 1:2], w, b), full[:, 1:2])
    assert torch.equal(gemm.linear(x.transpose(0, 1), w, b), full.transpose(0, 1))  # a strided input
    grad_input = gemm.input_grad(full, w)
    assert torch.equal(gemm.input_grad(full[:5], w), grad_input[:5])
    assert torch.equal(gemm.input_grad(full[:, 1:2], w), grad_input[:, 1:2])


def test_local_linear_gradients_match_f_linear(onednn):
    x, w, b = (t.requires_grad_() for t in _operands())
    grad = torch.randn(37, 3, 23)
    gemm.local_linear(x, w, b).backward(grad)
    ours = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    F.linear(x, w, b).backward(grad)
    for got, want in zip(ours, (x.grad, w.grad, b.grad)):
        assert ((got - want).norm() / want.norm()).item() < 1e-6  # float32 rounding of sums over 29 or 111 terms


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("kernel", ["torch", "onednn"])
def test_a_linear_output_may_be_overwritten_by_the_loss(kernel, with_bias):
    """The model's loss overwrites the logits in place: autograd forbids that on a custom function's view output
    (oneDNN's N-D result; F.linear's with a bias)."""
    if kernel == "onednn" and not gemm.onednn_available():
        pytest.skip("oneDNN's linear is not available")
    x, w, b = (t.requires_grad_() for t in _operands())
    b = b if with_bias else None
    target = torch.randint(0, 23, (37, 3))
    grads = []
    for loss in (vocab_parallel_cross_entropy_, vocab_parallel_cross_entropy):
        with gemm.onednn_gemm() if kernel == "onednn" else gemm.torch_gemm_only():
            loss(gemm.local_linear(x, w, b), target, 23, None).sum().backward()
        grads.append([t.grad.clone() for t in (x, w, b) if t is not None])
        for t in (x, w, b):
            if t is not None:
                t.grad = None
    assert all(torch.equal(ours, plain) for ours, plain in zip(*grads))


def test_float64_takes_f_linear_exactly():
    x, w, b = _operands(torch.float64)
    assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("with_bias, needs", [(True, (True, True, True)), (False, (True, True, False)),
                                               (True, (False, True, True)), (True, (True, False, False))])
def test_linear_function_backward_is_exact(with_bias, needs):
    """The p = 1 autograd function's own backward (float64 gradcheck: the same formulas run in float32), with and
    without a bias, and with an input or a weight that needs no gradient (frozen)."""
    x, w, b = _operands(torch.float64)
    args = [x[:4, :2].clone(), w[:5].clone(), b[:5].clone() if with_bias else None]
    for t, wants in zip(args, needs):
        if t is not None:
            t.requires_grad_(wants)
    assert torch.autograd.gradcheck(gemm._LinearFunction.apply, tuple(args))


def test_p1_layers_run_the_function_in_float32():
    x, w, b = (t.requires_grad_() for t in _operands())
    assert type(gemm.local_linear(x, w, b).grad_fn).__name__ == "_LinearFunctionBackward"


def test_the_probe_draws_no_random_numbers(onednn):
    """It runs inside the first forward: a draw there would move dropout's generator (and break bit-exact resume)."""
    gemm.onednn_available.cache_clear()
    before = torch.get_rng_state()
    assert gemm.onednn_linear_active()
    assert torch.equal(torch.get_rng_state(), before)


def test_autocast_takes_f_linear():
    x, w, b = _operands()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = gemm.local_linear(x, w, b)
        want = F.linear(x, w, b)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)


def test_torch_gemm_only_suspends_onednn_in_its_block(onednn):
    x, w, b = _operands()
    with gemm.torch_gemm_only():
        assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))
        assert torch.equal(gemm.input_grad(x[..., :23], w), x[..., :23].matmul(w))
    assert torch.equal(gemm.linear(x, w, b), torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""))


@pytest.mark.parametrize("setting", [None, "0"])
def test_torch_gemm_by_default_and_when_switched_off(monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv("PARALLEL_ATTENTION_ONEDNN_LINEAR", raising=False)
    else:
        monkeypatch.setenv("PARALLEL_ATTENTION_ONEDNN_LINEAR", setting)
    gemm.onednn_linear_active.cache_clear()
    try:
        x, w, b = (t.requires_grad_() for t in _operands())
        assert not gemm.onednn_linear_active()
        assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))
        assert torch.equal(gemm.input_grad(x[..., :23], w), x[..., :23].matmul(w))
        assert type(gemm.local_linear(x, w, b).grad_fn).__name__ == "_LinearFunctionBackward"  # on torch's GEMM
    finally:
        gemm.onednn_linear_active.cache_clear()


def test_onednn_gemm_turns_it_on_in_its_block_only():
    if not gemm.onednn_available():
        pytest.skip("oneDNN's linear is not available")
    x, w, b = _operands()
    onednn = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    with gemm.onednn_gemm():
        assert torch.equal(gemm.linear(x, w, b), onednn)
        with gemm.torch_gemm_only():  # the innermost block decides
            assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b) if not gemm.onednn_linear_active() else onednn)


def test_the_gemm_benchmark_writes_every_form(tmp_path):
    script = Path(__file__).resolve().parents[1] / "scripts" / "benchmark_gemm.py"
    out = tmp_path / "gemm.json"
    subprocess.run([sys.executable, str(script), "--tokens", "4", "--shape", "8,16", "--reps", "2", "--out", str(out)],
                   check=True, capture_output=True, timeout=120)
    result = json.loads(out.read_text())
    forms = {"forward_mkl", "dX_mkl", "dW_mkl", "dW_mkl_other_order"}
    forms |= {"forward_onednn", "dX_onednn"} if gemm.onednn_available() else set()
    assert set(result["shapes"][0]["ms"]) == forms and result["onednn_active"] == gemm.onednn_linear_active()
