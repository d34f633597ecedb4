"""The MLP's activations on this rank's fc_in output: GELU (tanh form, as GPT-2) and SwiGLU.

SwiGLU has its own backward. It keeps what autograd's graph of SiLU(gate) * up keeps (the fused input and
SiLU(gate); recomputing SiLU(gate) in backward measured slower, its exp costing more than the pass it saves),
and writes both halves of the gradient of the fused [gate | up] columns straight into one buffer, where
autograd assembles them with one more copy (the backward of chunk). Its forward computes what the plain
expression does, bit for bit; the gradients are those of torch's own silu_backward and mul. Under
torch.compile the plain expression is traced instead: dynamo cannot trace `out=` into a strided half, and
inductor fuses the expression itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def gelu_tanh(y: torch.Tensor) -> torch.Tensor:
    return F.gelu(y, approximate="tanh")


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        gate, up = y.chunk(2, dim=-1)
        activated = F.silu(gate)
        ctx.save_for_backward(y, activated)
        return activated * up

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        y, activated = ctx.saved_tensors
        gate, up = y.chunk(2, dim=-1)
        grad_y = torch.empty_like(y)
        grad_gate, grad_up = grad_y.chunk(2, dim=-1)
        torch.mul(grad, activated, out=grad_up)  # d/d up of SiLU(gate) * up
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_y


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up on this rank's fused [gate_r | up_r] columns (y [..., 2 f/p] -> [..., f/p])."""
    if torch.compiler.is_compiling():
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    return _SwiGLUFunction.apply(y)
