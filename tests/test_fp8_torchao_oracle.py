"""Our FP8 linears against an implementation written by others: torchao's `Float8Linear` with `emulate=True` (its
CPU path: quantize, dequantize, multiply in float32), on the same weights and inputs. A test oracle only: this file
skips where torchao is not installed (`pip install -e '.[oracle]'`), and the library never imports it.

torchao configured to our recipes (docs/fp8.md):
- tensorwise: its "tensorwise" recipe (X and W e4m3, dY e5m2, one dynamic scale each, dY and X quantized again for
  dW with the same scales) with `round_scales_to_power_of_2=True`; its default scale is fmax / amax itself;
- rowwise: its "rowwise" recipe as it is (X, W and dY e4m3, one power-of-two scale per row of each GEMM's operand
  along the contraction dimension: X per token and W per output row; dY per token and W per input column;
  dY per output feature and X per input feature).
Then outputs, input gradients and weight and bias gradients are equal bit for bit, float32 and bfloat16, random,
all-zero and outlier inputs alike, and NaN in the same places after an inf in dY. The differences found, each
pinned by a test below:
- near a power of two, the scale: torchao floors float32's log2 of fmax / amax, which rounds a ratio a few ulps
  below a power of two up to it, giving twice our scale (ours is the exact floor, by frexp), so amax * scale
  passes fmax by an ulp and saturates. With its scale function swapped for ours, the linears agree again;
- under CPU autocast: torchao casts its input only under CUDA autocast (so it is given the bf16 input here, as its
  forward casts it on a GPU), and returns dW and db in dY's dtype (bf16) where ours keeps the parameters' (float32):
  ours rounded to bf16 equals torchao's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from parallel_attention.tensor_parallel.fp8 import E4M3, E5M2, scale_for
from parallel_attention.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from parallel_attention.tensor_parallel.linear_precision import fp8_linears
from test_fp8 import run_linear

torchao_float8 = pytest.importorskip("torchao.float8", reason="the oracle needs torchao (pip install -e '.[oracle]')")
float8_utils = pytest.importorskip("torchao.float8.float8_utils")

S, B, IN, OUT = 12, 5, 264, 136  # awkward sizes, K large enough for the GEMMs' blocking to show a summation order


def torchao_twin(layer, recipe: str, **changes):
    """torchao's Float8Linear holding `layer`'s weight and bias (copies), configured to our `recipe`."""
    config = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, **{"emulate": True, "round_scales_to_power_of_2": True, **changes})
    linear = torch.nn.Linear(IN, OUT, bias=True, dtype=layer.weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(layer.weight)
        linear.bias.copy_(layer.bias)
    return torchao_float8.convert_to_float8_training(torch.nn.Sequential(linear), config=config)[0]


def layer_and_twin(kind, recipe: str, dtype=torch.float32, **changes):
    torch.manual_seed(1)
    layer = kind(IN, OUT, bias=True).to(dtype)
    with torch.no_grad():
        layer.bias.normal_()
    return layer, torchao_twin(layer, recipe, **changes)


def results(module, x, grad, **autocast):
    """(Y, dX, dW, db)."""
    return (*run_linear(module, x, grad, **autocast), module.bias.grad)


def ours(layer, recipe: str, x, grad, **autocast):
    with fp8_linears(recipe, "cpu"):
        return results(layer, x, grad, **autocast)


def data(case: str, dtype):
    torch.manual_seed(2)
    x, grad = torch.randn(S, B, IN), torch.randn(S, B, OUT)
    if case == "zeros":
        x = torch.zeros(S, B, IN)
    elif case == "outlier":  # near float32's largest: X's other values flush to zero (rowwise: its token's)
        x[3, 1, 7], grad = 3e37, grad * 1e-30
    elif case == "inf":  # an fp16 overflow in dY: non-finite results, NaN in the same places
        grad[1, 2, 3] = float("inf")
    return x.to(dtype), grad.to(dtype)


@pytest.mark.parametrize("case", ["random", "zeros", "outlier", "inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("kind", [ColumnParallelLinear, RowParallelLinear])
def test_equals_torchao_bit_for_bit(kind, recipe, dtype, case):
    layer, twin = layer_and_twin(kind, recipe, dtype)
    x, grad = data(case, dtype)
    for got, want in zip(ours(layer, recipe, x, grad), results(twin, x, grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # exact, dtypes included


def test_the_oracle_tells_a_different_recipe_apart():
    """Not vacuous: torchao's own tensorwise scales (fmax / amax, not powers of two) give other numbers."""
    layer, twin = layer_and_twin(ColumnParallelLinear, "tensorwise", round_scales_to_power_of_2=False)
    x, grad = data("random", torch.float32)
    assert not any(torch.equal(got, want) for got, want in
                   zip(ours(layer, "tensorwise", x, grad)[:3], results(twin, x, grad)[:3]))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_under_bf16_autocast_only_the_gradients_dtype_differs(recipe):
    """float32 parameters under CPU bf16 autocast. torchao's forward casts its input only under CUDA autocast:
    it is given the bf16 input its GPU path would cast. Y and dX are equal; torchao returns dW and db in dY's
    dtype (bf16), ours in the parameters' (float32): ours rounded to bf16 equals it."""
    layer, twin = layer_and_twin(ColumnParallelLinear, recipe)
    x, grad = data("random", torch.float32)
    y, dx, dw, db = ours(layer, recipe, x, grad.bfloat16(), dtype=torch.bfloat16)
    ty, tdx, tdw, tdb = results(twin, x.bfloat16(), grad.bfloat16(), dtype=torch.bfloat16)
    assert torch.equal(y, ty) and torch.equal(dx, tdx.float())  # run_linear returns Y in float32
    assert dw.dtype == torch.float32 and torch.equal(dw.bfloat16().float(), tdw)
    assert torch.equal(db.bfloat16().float(), tdb)
    assert not torch.equal(dw, tdw)  # torchao's dW did lose bf16's rounding


def just_above_powers_of_two(fmt) -> torch.Tensor:
    """amaxes 1 to 4 float32 ulps above fmax * 2^k, k in -24..24: fmax / amax lies just below 2^-k."""
    amax, above = torch.tensor([torch.finfo(fmt).max * 2.0 ** k for k in range(-24, 25)]), []
    for _ in range(4):
        amax = torch.nextafter(amax, torch.tensor(float("inf")))
        above.append(amax)
    return torch.cat(above)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_scales_equal_torchao_s_except_just_below_a_power_of_two(fmt):
    """Ours is 2^floor(log2(fmax / amax)) exactly; torchao's float32 log2 rounds a ratio within a few ulps below a
    power of two up to it: twice our scale there, and amax * scale then passes fmax (saturated to it)."""
    torch.manual_seed(3)
    amax = torch.rand(100_000) * 10.0 ** torch.randint(-30, 30, (100_000,)).float()
    amax = torch.cat([amax, torch.tensor([0.0, 1e-30, 1.0, 3e38])])
    assert torch.equal(scale_for(amax, fmt), float8_utils.amax_to_scale(amax, fmt, True))
    near = just_above_powers_of_two(fmt)
    scale, theirs = scale_for(near, fmt), float8_utils.amax_to_scale(near, fmt, True)
    fmax = torch.finfo(fmt).max
    assert (near * scale <= fmax).all() and (near * scale * 2 > fmax).all()  # the exact floor
    differ = scale != theirs
    assert differ.any() and torch.equal(theirs[differ], 2 * scale[differ])
    assert (near[differ] * theirs[differ] > fmax).all()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_with_our_scales_torchao_agrees_near_a_power_of_two(recipe, monkeypatch):
    """X's amax (token 0's too) one ulp above 448 / 8: torchao scales it by 8, we by 4. A power of two more
    changes only what falls below e4m3's normal numbers: a value of 1.3e-3 beside it quantizes to 3 * 2^-9 / 4
    with our scale, 5 * 2^-9 / 8 with torchao's, so the outputs differ; with torchao's scale function replaced by
    ours, every result is equal again: the scale is the only difference."""
    layer, twin = layer_and_twin(RowParallelLinear, recipe)
    x, grad = data("random", torch.float32)
    x[0, 0, 0], x[0, 0, 1] = torch.nextafter(torch.tensor(56.0), torch.tensor(100.0)), 1.3e-3
    assert float8_utils.amax_to_scale(x.abs().amax(), E4M3, True) == 2 * scale_for(x.abs().amax(), E4M3)
    expected = ours(layer, recipe, x, grad)
    assert not torch.equal(expected[0], results(twin, x, grad)[0])
    monkeypatch.setattr(float8_utils, "amax_to_scale", lambda amax, fmt, **_: scale_for(amax, fmt))
    assert all(torch.equal(got, want) for got, want in zip(expected, results(twin, x, grad)))
