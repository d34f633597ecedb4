"""In which precision the parallel linears multiply: their input's (the default), or FP8 (`training.fp8`).

The policy is swapped by a context (`fp8_linears`), as the weight-gradient deferral is: the autograd functions of
`linear_functions` ask their layer's precision for one call's three GEMMs (`column(group)` / `row(group)`) and never
test a mode. The layers' linears follow the policy (`FOLLOW_POLICY`); the output layer keeps `HIGH_PRECISION`.

FP8 scales are dynamic (this call's amax; fp8.py's power-of-two scales). Wherever the amax of a scale spans ranks,
it is one MAX all-reduce over them, batched per GEMM, so that any layout computes one process's scales (MAX is
exact). Shapes: T tokens of this rank (s·b), `in`/`out` features, p the TP size.

    recipe      GEMM               operands (format, scale over)                    MAX all-reduce of the amax
    tensorwise  Y = X W^T          X e4m3 (all), W e4m3 (all)                       tp (W; the row's X); dp x cp*
                dX = dY W          dY e5m2 (all), W as in forward                   tp for the column's dY; dp x cp*
                dW = dY^T X        dY as for dX, X as in forward                    none (reused)
    rowwise     Y = X W^T          X e4m3 (each token), W e4m3 (each out row)       tp for the row linear (in split)
                dX = dY W          dY e4m3 (each token), W e4m3 (each in column)    tp for the column (out split)
                dW = dY^T X        dY e4m3 (each out), X e4m3 (each in), over T     dp x cp*
    * only with global scales (training.fp8_global_scales): the scales that reduce over tokens.

Tensorwise follows Micikevicius et al. 2022 (e4m3 forward, e5m2's range for gradients). Rowwise keeps e4m3 for the
gradients too, as torchao's rowwise recipe does: a scale per row already follows the gradient's range, e4m3's
third mantissa bit halves the rounding error.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .collectives import all_reduce
from .fp8 import E4M3, E5M2, amax, quantize, scale_for, scaled_matmul_for
from .parallel_state import ProcessGroup, group_size


class HighPrecisionGemms:
    """The three GEMMs in the input's precision (the autocast dtype, else the parameters')."""

    def forward(self, x, weight, bias):
        return F.linear(x, weight, bias)

    def input_grad(self, grad, weight):
        return grad.matmul(weight.to(grad.dtype))

    def weight_grad(self, grad, x, weight):
        """dW from 2-D [T, out] dY and [T, in] X."""
        return grad.t().mm(x.to(grad.dtype))


class HighPrecision:
    """A precision: every call's GEMMs in high precision."""

    gemms = HighPrecisionGemms()

    def column(self, tp_group: ProcessGroup | None):
        return self.gemms

    def row(self, tp_group: ProcessGroup | None):
        return self.gemms


def max_over(group: ProcessGroup | None, *amaxes: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The amaxes' MAX over `group`, as one all-reduce of them all (none on a group of one rank)."""
    if group_size(group) == 1:
        return amaxes
    flat = all_reduce(torch.cat([a.reshape(-1) for a in amaxes]), group, dist.ReduceOp.MAX)
    return tuple(part.reshape(a.shape) for part, a in zip(flat.split([a.numel() for a in amaxes]), amaxes))


class QuantizedInLinear:
    """The FP8 GEMMs' weights in their own precision, quantized by the linear with the scale of this call's amax
    (reduced with X's); `fp8_all_gather.GATHERED_IN_FP8` reads weights FSDP2 gathered in e4m3 instead."""

    scaled_in_linear = True  # the weight's amax is taken here, so a split weight's is reduced here

    @staticmethod
    def amaxes(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (amax(weight, None),)

    @staticmethod
    def scale(weight: torch.Tensor, amaxes: tuple) -> torch.Tensor:
        return scale_for(amaxes[0], E4M3)

    @staticmethod
    def quantized(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return quantize(weight, scale, E4M3)


QUANTIZED_IN_LINEAR = QuantizedInLinear()


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _with_bias(y: torch.Tensor, shape, bias):
    y = y.reshape(*shape[:-1], y.shape[-1])
    return y if bias is None else y + bias.to(y.dtype)


class Fp8Gemms:
    """One call's FP8 GEMMs: the groups their amaxes are reduced over (forward; dX; dp x cp or None), the
    scaled matmul and where the weights' FP8 form comes from (tensorwise: `weights`)."""

    def __init__(self, forward_group, grad_group, data_group, matmul, weights=QUANTIZED_IN_LINEAR) -> None:
        self.forward_group, self.grad_group, self.data_group = forward_group, grad_group, data_group
        self.matmul, self.weights = matmul, weights


class TensorwiseGemms(Fp8Gemms):
    """One call's FP8 GEMMs with one scale per tensor; the forward's scales and dY's are kept for backward."""

    scaled_grad = None  # (dY in e5m2, its scale), made by the first backward GEMM

    @staticmethod
    def column_groups(tp_group, weights):
        """(forward, dX) amax groups of a column linear: W's rows and dY's features are split over tp. X is whole
        on every rank, so a weight whose scale came with it (GATHERED_IN_FP8) leaves the forward nothing to reduce."""
        return (tp_group if weights.scaled_in_linear else None), tp_group

    def forward(self, x, weight, bias):
        x2 = _rows(x)
        ax, *aw = max_over(self.forward_group, amax(x2, None), *self.weights.amaxes(weight))
        ax, *aw = max_over(self.data_group, ax, *aw)
        self.sx, self.sw = scale_for(ax, E4M3), self.weights.scale(weight, aw)
        y = self.matmul(quantize(x2, self.sx, E4M3), self.sx, self.weights.quantized(weight, self.sw).t(), self.sw,
                        x.dtype)
        return _with_bias(y, x.shape, bias)

    def _scaled(self, grad2):
        """dY in e5m2 and its scale, made once for dX and dW."""
        if self.scaled_grad is None:
            (ag,) = max_over(self.grad_group, amax(grad2, None))
            (ag,) = max_over(self.data_group, ag)
            sg = scale_for(ag, E5M2)
            self.scaled_grad = quantize(grad2, sg, E5M2), sg
        return self.scaled_grad

    def input_grad(self, grad, weight):
        qg, sg = self._scaled(_rows(grad))
        dx = self.matmul(qg, sg, self.weights.quantized(weight, self.sw), self.sw, grad.dtype)
        return dx.reshape(*grad.shape[:-1], dx.shape[-1])

    def weight_grad(self, grad, x, weight):
        qg, sg = self._scaled(grad)
        return self.matmul(qg.t(), sg, quantize(x, self.sx, E4M3), self.sx, weight.dtype)


class RowwiseGemms(Fp8Gemms):
    """One call's FP8 GEMMs with one scale per row of each operand along the contraction dimension (all e4m3)."""

    @staticmethod
    def column_groups(tp_group, weights):
        """(forward, dX) amax groups of a column linear: rows of X and W are whole; dY's and W's columns split."""
        return None, tp_group

    def forward(self, x, weight, bias):
        x2 = _rows(x)
        ax, aw = max_over(self.forward_group, amax(x2, 1), amax(weight, 1))  # [T, 1] tokens, [out, 1] rows of W
        sx, sw = scale_for(ax, E4M3), scale_for(aw, E4M3)
        y = self.matmul(quantize(x2, sx, E4M3), sx, quantize(weight, sw, E4M3).t(), sw.t(), x.dtype)
        return _with_bias(y, x.shape, bias)

    def input_grad(self, grad, weight):
        grad2 = _rows(grad)
        ag, aw = max_over(self.grad_group, amax(grad2, 1), amax(weight, 0))  # [T, 1] tokens, [1, in] columns of W
        sg, sw = scale_for(ag, E4M3), scale_for(aw, E4M3)
        dx = self.matmul(quantize(grad2, sg, E4M3), sg, quantize(weight, sw, E4M3), sw, grad.dtype)
        return dx.reshape(*grad.shape[:-1], dx.shape[-1])

    def weight_grad(self, grad, x, weight):
        ag, ax = max_over(self.data_group, amax(grad, 0), amax(x, 0))  # [1, out], [1, in]: over the tokens
        sg, sx = scale_for(ag, E4M3), scale_for(ax, E4M3)
        return self.matmul(quantize(grad, sg, E4M3).t(), sg.t(), quantize(x, sx, E4M3), sx, weight.dtype)


class Fp8:
    """A precision: every call's GEMMs in FP8 as `gemms` (TensorwiseGemms or RowwiseGemms) computes them with
    `matmul`, the amax of token-dependent scales also over `data_group` (dp x cp; None: each data-parallel rank's
    own tokens, the anchors' behaviour)."""

    def __init__(self, gemms, matmul, data_group: ProcessGroup | None, weights=QUANTIZED_IN_LINEAR) -> None:
        self.gemms_class, self.matmul, self.data_group, self.weights = gemms, matmul, data_group, weights

    def column(self, tp_group):
        """W split by output rows; X whole on every rank (gathered under SP), dY split by output features."""
        return self.gemms_class(*self.gemms_class.column_groups(tp_group, self.weights), self.data_group,
                                self.matmul, self.weights)

    def row(self, tp_group):
        """W and X split by input features; dY whole on every rank (gathered under SP)."""
        return self.gemms_class(tp_group, None, self.data_group, self.matmul, self.weights)


HIGH_PRECISION = HighPrecision()
_policy = HIGH_PRECISION
RECIPES = {"tensorwise": TensorwiseGemms, "rowwise": RowwiseGemms}


class FollowPolicy:
    """The layers' precision: whichever the policy is when the call runs (high precision, or `fp8_linears`')."""

    def column(self, tp_group):
        return _policy.column(tp_group)

    def row(self, tp_group):
        return _policy.row(tp_group)


FOLLOW_POLICY = FollowPolicy()


@contextlib.contextmanager
def fp8_linears(recipe: str, device, data_group: ProcessGroup | None = None, weights=QUANTIZED_IN_LINEAR):
    """Inside: the layers' linears multiply in FP8 by `recipe` ("tensorwise" or "rowwise"; "none": unchanged),
    with `device`'s scaled matmul (`_scaled_mm` on CUDA, the emulation elsewhere); `data_group`: global scales;
    `weights`: tensorwise weights quantized in the linear, or gathered in e4m3 (`fp8_all_gather`)."""
    global _policy
    previous = _policy
    if recipe == "rowwise" and weights is not QUANTIZED_IN_LINEAR:
        raise ValueError("rowwise FP8 quantizes each weight twice (per output row, per input column): its "
                         "weights are not gathered in FP8; pass weights only with recipe='tensorwise'.")
    if recipe != "none":
        _policy = Fp8(RECIPES[recipe], scaled_matmul_for(device), data_group, weights)
    try:
        yield
    finally:
        _policy = previous
