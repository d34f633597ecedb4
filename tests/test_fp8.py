"""FP8 linears on one process: the CPU emulation equals a reference quantize -> dequantize -> matmul written here bit
for bit, its error against float32 stays within torchao's SQNR thresholds, no scale turns into inf or NaN, and the
output layers and every linear outside `fp8_linears` keep their high-precision numbers."""

from __future__ import annotations

import pytest
import torch

from parallel_attention.hf.tp_embedding import VocabParallelHead
from parallel_attention.tensor_parallel.fp8 import quantize, scale_for
from parallel_attention.tensor_parallel.layers import (ColumnParallelLinear, OutputLinear, RowParallelLinear,
                                                      TiedOutputLayer, VocabParallelEmbedding)
from parallel_attention.tensor_parallel.linear_precision import fp8_linears

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
S, B, IN, OUT = 6, 3, 40, 24  # awkward sizes: a transposed or mis-scaled dimension cannot pass by accident


def reference(x: torch.Tensor, fmt: torch.dtype, dim: int | None) -> torch.Tensor:
    """x quantized with the largest power-of-two scale that keeps max |x| (over `dim`, or all) inside the format,
    then dequantized: written apart from the library (log2 and floor, not frexp)."""
    fmax = torch.finfo(fmt).max
    peak = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(fmax / peak)))
    return (x * scale).clamp(-fmax, fmax).to(fmt).to(torch.float32) / scale


def reference_gemms(recipe: str, x2, w, g2):
    """(Y, dX, dW) of Y = X W^T from quantized, dequantized operands, each scale as the recipe says."""
    if recipe == "tensorwise":
        xd, wd, gd = reference(x2, E4M3, None), reference(w, E4M3, None), reference(g2, E5M2, None)
        return xd @ wd.t(), gd @ wd, gd.t() @ xd
    y = reference(x2, E4M3, 1) @ reference(w, E4M3, 1).t()  # per token, per output row
    dx = reference(g2, E4M3, 1) @ reference(w, E4M3, 0)  # per token, per input column
    dw = reference(g2, E4M3, 0).t() @ reference(x2, E4M3, 0)  # per output feature, per input feature
    return y, dx, dw


def run_linear(layer, x, grad, **autocast):
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", **autocast) if autocast else torch.autocast("cpu", enabled=False):
        y = layer(x)
    y.backward(grad)
    return y.detach().float(), x.grad, layer.weight.grad


def inputs(seed=0):
    torch.manual_seed(seed)
    return torch.randn(S, B, IN), torch.randn(S, B, OUT)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("kind", [ColumnParallelLinear, RowParallelLinear])
def test_emulation_equals_the_reference_bit_for_bit(recipe, kind):
    torch.manual_seed(1)
    layer = kind(IN, OUT, bias=True)
    with torch.no_grad():
        layer.bias.normal_()
    x, grad = inputs()
    with fp8_linears(recipe, "cpu"):
        y, dx, dw = run_linear(layer, x, grad)
    ry, rdx, rdw = reference_gemms(recipe, x.reshape(-1, IN), layer.weight.detach(), grad.reshape(-1, OUT))
    assert torch.equal(y, ry.reshape(S, B, OUT) + layer.bias.detach())
    assert torch.equal(dx, rdx.reshape(S, B, IN))
    assert torch.equal(dw, rdw)


def sqnr(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (10 * torch.log10(expected.pow(2).sum() / (actual - expected).pow(2).sum())).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_sqnr_against_float32(recipe, dtype):
    """torchao's thresholds for its float8 linears: >= 18 dB on outputs, >= 17 dB on weight gradients (measured
    here 28.4 and 24.5 dB tensorwise, 28.4 and 28.4 dB rowwise); dX as outputs (24.6 dB: e5m2 dY)."""
    torch.manual_seed(2)
    layer = ColumnParallelLinear(IN * 4, OUT * 4, bias=False)
    x, grad = torch.randn(S * 8, B, IN * 4), torch.randn(S * 8, B, OUT * 4)
    exact = run_linear(layer, x, grad)
    autocast = {"dtype": dtype} if dtype else {}
    with fp8_linears(recipe, "cpu"):
        y, dx, dw = run_linear(layer, x, grad, **autocast)
    assert sqnr(y, exact[0]) >= 18 and sqnr(dx.float(), exact[1]) >= 18
    assert sqnr(dw, exact[2]) >= 17


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_all_zero_tensors_and_outliers_stay_finite_and_an_inf_stays_non_finite(recipe):
    torch.manual_seed(3)
    layer = RowParallelLinear(IN, OUT, bias=False)
    zeros = torch.zeros(S, B, IN)
    outlier = torch.randn(S, B, IN)
    outlier[2, 1, 7] = 3e37  # near float32's largest: the scale stays a normal float32 number
    with fp8_linears(recipe, "cpu"):
        for x, grad in ((zeros, torch.zeros(S, B, OUT)), (zeros, torch.randn(S, B, OUT)),
                        (outlier, torch.randn(S, B, OUT) * 1e-30)):
            y, dx, dw = run_linear(layer, x, grad)
            assert all(torch.isfinite(t).all() for t in (y, dx, dw))
    assert torch.equal(run_linear(layer, zeros, torch.zeros(S, B, OUT))[0], torch.zeros(S, B, OUT))
    with fp8_linears(recipe, "cpu"):  # an fp16 overflow stays visible to the loss scaler: never saturated
        overflow = torch.randn(S, B, OUT)
        overflow[1, 2, 3] = float("inf")
        assert not any(torch.isfinite(t).all() for t in run_linear(layer, outlier, overflow)[1:])
    for peak in (0.0, 1e-30, 1.0, 3.4e38):
        scale = scale_for(torch.tensor(peak), E4M3)
        assert torch.isfinite(scale) and scale > 0
        assert torch.isfinite(quantize(torch.tensor([peak, -peak]), scale, E4M3).float()).all()


def test_output_layers_and_no_policy_keep_high_precision():
    """Inside fp8_linears the output layers multiply as outside it; outside it, every linear as before."""
    torch.manual_seed(4)
    embedding = VocabParallelEmbedding(OUT, IN)
    heads = [TiedOutputLayer(embedding), OutputLinear(IN, OUT, bias=False),
             VocabParallelHead(torch.randn(OUT, IN), None)]  # parallelize()'s head of Hugging Face models
    column, x = ColumnParallelLinear(IN, OUT), torch.randn(S, B, IN)
    before = [head(x) for head in heads] + [column(x)]
    with fp8_linears("tensorwise", "cpu"):
        assert all(torch.equal(head(x), b) for head, b in zip(heads, before))
        assert not torch.equal(column(x), before[-1])  # the layers' linears do run in FP8
    with fp8_linears("none", "cpu"):
        assert torch.equal(column(x), before[-1])
    assert torch.equal(column(x), before[-1])  # the context restored the policy


def test_config_keys_are_validated():
    """training.fp8 is none by default; an unknown recipe and global scales without FP8 are refused, named."""
    from launch import ROOT

    from parallel_attention import load_config
    from parallel_attention.training.config.checks import ConfigError

    tiny = ROOT / "configs" / "gpt_tiny.yaml"
    default = load_config(tiny)
    assert (default.training.fp8, default.training.fp8_global_scales) == ("none", False)
    cfg = load_config(tiny, ["--training.fp8=rowwise", "--training.fp8_global_scales=true"])
    cfg.validate(2)  # gpt_tiny.yaml is tp 2
    with pytest.raises(ValueError, match="training.fp8='fp4'.*tensorwise"):
        load_config(tiny, ["--training.fp8=fp4"])
    with pytest.raises(ConfigError, match="fp8_global_scales=true needs FP8 linears"):
        load_config(tiny, ["--training.fp8_global_scales=true"]).validate(2)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("kind", [ColumnParallelLinear, RowParallelLinear])
def test_the_scaled_mm_call_equals_the_emulation(recipe, kind):
    """The CUDA path's torch._scaled_mm call (row- and column-major operands, inverse scales, rowwise scale shapes,
    bf16 rowwise output) through torch's CPU kernel, against the emulation: tensorwise within float32 summation
    order (1e-6), rowwise within one bf16 ulp of each output (it comes out in bf16 there, which rounds by half of
    one). The GPU itself is gpu_check's fp8 step."""
    from functools import partial

    from parallel_attention.tensor_parallel import linear_functions as fn
    from parallel_attention.tensor_parallel.fp8 import cuda_scaled_matmul, emulated_scaled_matmul
    from parallel_attention.tensor_parallel.linear_precision import RECIPES, Fp8

    torch.manual_seed(5)
    w, x, grad = torch.randn(48, 64), torch.randn(4, 8, 64), torch.randn(4, 8, 48)  # multiples of 16
    results = []
    for matmul in (partial(cuda_scaled_matmul, returns_amax=False), emulated_scaled_matmul):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        precision = Fp8(RECIPES[recipe], matmul, None)
        y = (fn.column_parallel_linear(xs, ws, None, fn.LOCAL_COLUMN, precision) if kind is ColumnParallelLinear
             else fn.row_parallel_linear(xs, ws, fn.LOCAL_ROW, precision))
        y.backward(grad)
        results.append((y.detach(), xs.grad, ws.grad))
    for got, want in zip(*results):
        bound = 1e-6 * want.abs().max() if recipe == "tensorwise" else torch.finfo(torch.bfloat16).eps * want.abs()
        assert ((got - want).abs() <= bound + 1e-30).all()
