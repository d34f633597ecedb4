"""FP8 numbers: the two formats, dynamic power-of-two scales, quantization, and the scaled matmul (torch's
`_scaled_mm` on CUDA, an emulation elsewhere).

A scaled tensor is (q, scale): q = saturate(x * scale) in an FP8 format, x ~ q / scale. The scale comes from the
tensor's amax, over the whole tensor (tensorwise, a 0-dim scale) or over each row of the matmul operand along the
contraction dimension (rowwise, a [rows, 1] or [1, columns] scale), rounded down to a power of two so that
scaling and unscaling are exact and the largest value still fits:

    scale = 2^floor(log2(fmax / max(amax, AMAX_FLOOR)))        fmax = 448 (e4m3), 57344 (e5m2)

An all-zero tensor (amax 0) gets the finite scale of AMAX_FLOOR and quantizes to zeros; an outlier only lowers the
scale (every finite float32 amax gives a normal float32 scale); nothing here makes an inf or a NaN of finite input,
and a tensor holding an inf or a NaN comes out all NaN (never saturated into finite numbers).

`scaled_matmul(a, sa, b, sb, out_dtype)` is (a / sa) @ (b / sb) for FP8 a [M, K], b [K, N] (any strides) with scales
broadcastable to a's rows ([M, 1] or 0-dim) and b's columns ([1, N] or 0-dim). `emulated_scaled_matmul` dequantizes
to float32 and multiplies there: the CPU's FP8 path, equal bit for bit to quantize -> dequantize -> matmul.
`cuda_scaled_matmul` calls `torch._scaled_mm` (row-major a, column-major b, the inverse scales, rowwise in bf16).
"""

from __future__ import annotations

import functools

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2  # forward operands; gradients (tensorwise)
AMAX_FLOOR = 1e-12  # an amax below it (an all-zero tensor) scales as this one: finite, and quantizes to zeros


def amax(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """max |x| in float32: over the whole tensor (dim None, 0-dim) or along `dim` of a 2-D x (kept, size 1)."""
    x = x.detach()
    return (x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)).float()


def scale_for(amax_: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The power of two 2^floor(log2(fmax / amax)), float32, finite for every finite amax; NaN for an inf or NaN
    amax, so that a non-finite tensor stays non-finite (saturating it would hide an fp16 overflow from the loss
    scaler and a divergence from its guard)."""
    ratio = torch.finfo(dtype).max / amax_.clamp(min=AMAX_FLOOR)
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    scale = torch.ldexp(torch.ones_like(ratio), exponent - 1)
    return torch.where(torch.isfinite(amax_), scale, torch.nan)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale saturated to the format's range (a cast alone would make NaN of what overflows e4m3), in FP8."""
    fmax = torch.finfo(dtype).max
    return (x.detach().float() * scale).clamp(-fmax, fmax).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q / scale in float32 (exact: the scale is a power of two)."""
    return q.float() / scale


def emulated_scaled_matmul(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                           out_dtype: torch.dtype) -> torch.Tensor:
    """(a / sa) @ (b / sb) dequantized to float32 and multiplied there (autocast off), then cast to out_dtype."""
    with torch.autocast(a.device.type, enabled=False):
        return torch.matmul(dequantize(a, sa), dequantize(b, sb)).to(out_dtype)


def _scaled_mm_returns_amax() -> bool:
    """torch before 2.4 returned (out, amax) from _scaled_mm; 2.4 and later (2.11, 2.13 included) the output."""
    return len(torch.ops.aten._scaled_mm.default._schema.returns) == 2


def cuda_scaled_matmul(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                       out_dtype: torch.dtype, returns_amax: bool = False) -> torch.Tensor:
    """torch._scaled_mm on a row-major a and a column-major b with the inverse (dequantizing) scales. Rowwise scales
    need a bf16 output (cast after); K and N must be multiples of 16."""
    rowwise = sa.dim() > 0  # tensorwise scales are 0-dim
    out = torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=sa.reciprocal().float(),
                           scale_b=sb.reciprocal().float(),
                           out_dtype=torch.bfloat16 if rowwise else out_dtype)
    return (out[0] if returns_amax else out).to(out_dtype)


def scaled_matmul_for(device: torch.device):
    """The scaled matmul of `device`, chosen once: `_scaled_mm` on CUDA, the float32 emulation elsewhere."""
    if torch.device(device).type != "cuda":
        return emulated_scaled_matmul
    return functools.partial(cuda_scaled_matmul, returns_amax=_scaled_mm_returns_amax())
