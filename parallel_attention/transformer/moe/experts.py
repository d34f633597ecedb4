"""The routed experts of one MoE layer on one rank, held as stacked weights and run on tokens sorted by expert.

    x [N, h], rows grouped by expert (counts [E_local], in expert order)
      | gate_up_proj [E_local, 2f, h] per group (SwiGLU: [gate | up]) or fc_in [E_local, f, h] (GELU)
      | SiLU(gate) * up, or GELU
      | down_proj [E_local, h, f] (SwiGLU) or fc_out [E_local, h, f]
    y [N, h]

The stacked layout is transformers 5's fused one (`experts.gate_up_proj`, `experts.down_proj`), so a canonical
state dict names each layer's experts in two tensors, expert e at row e. Two ways to run them, chosen once:
`torch._grouped_mm` (one kernel for every expert; on CPU since torch 2.13, on CUDA from sm90; row strides must be
multiples of 16 bytes, so h and f multiples of 8) or a loop over the experts (any dtype and size).
"""

from __future__ import annotations

import torch
from torch import nn

from ..activations import gelu_tanh, swiglu


def grouped_mm_refusal(hidden_size: int, ffn_hidden_size: int, device, dtype: torch.dtype) -> str | None:
    """Why torch._grouped_mm cannot run these experts (None: it can)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"torch._grouped_mm takes float32, bfloat16 or float16, not {dtype}"
    if hidden_size % 8 or ffn_hidden_size % 8:
        return (f"hidden_size={hidden_size} and the expert ffn_hidden_size={ffn_hidden_size} must be multiples of 8 "
                "(16-byte row strides)")
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return "torch._grouped_mm needs a GPU of compute capability 9.0 or newer"
    return None


def expert_paths() -> dict[str, str]:
    """How MoE experts run in this environment, and when (each layer's choice: MoELayer.active_paths())."""
    where = ("CPU" + (", and CUDA from compute capability 9.0" if torch.cuda.is_available() else "")
             if hasattr(torch, "_grouped_mm") else None)
    grouped = (f"torch._grouped_mm on {where} for float32, bfloat16 and float16 when the hidden and expert widths are "
               "multiples of 8; a loop over the experts otherwise") if where else \
        f"a loop over the experts (torch {torch.__version__} has no torch._grouped_mm)"
    return {"MoE experts (model.num_experts > 0)": grouped}


def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, counts: list[int] | None) -> torch.Tensor:
    """x [N, in] @ weight[e]^T for each group: weight [E, out, in], offsets the groups' cumulative ends (int32).
    Under torch.compile outside bfloat16 the loop is traced instead: dynamo's fake kernel of torch._grouped_mm
    (torch 2.13) accepts bfloat16 only."""
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return _looped(x, weight, offsets, torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist())
    return torch._grouped_mm(x, weight.to(x.dtype).transpose(-2, -1), offs=offsets)


def _looped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, counts: list[int]) -> torch.Tensor:
    pieces = x.split(counts, dim=0)
    return torch.cat([piece @ w.to(x.dtype).t() for piece, w in zip(pieces, weight.unbind(0))], dim=0)


class GroupedExperts(nn.Module):
    """`num_local` experts (global ids first_expert ...); weights drawn by the caller (see MoELayer)."""

    def __init__(self, num_local: int, hidden_size: int, ffn_hidden_size: int, activation: str, device=None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if activation not in ("gelu", "swiglu"):
            raise ValueError(f"activation={activation!r} is unknown; choose gelu or swiglu.")
        self.num_local, self.gated = num_local, activation == "swiglu"
        h, f = hidden_size, ffn_hidden_size
        self.in_name, self.out_name = ("gate_up_proj", "down_proj") if self.gated else ("fc_in", "fc_out")
        self.register_parameter(self.in_name, nn.Parameter(
            torch.empty(num_local, 2 * f if self.gated else f, h, device=device, dtype=dtype)))
        self.register_parameter(self.out_name, nn.Parameter(torch.empty(num_local, h, f, device=device, dtype=dtype)))
        self._activation = swiglu if self.gated else gelu_tanh
        self.refusal = grouped_mm_refusal(h, f, device, dtype)
        self._matmul = _looped if self.refusal else _grouped
        self._needs_counts = self.refusal is not None

    def active_path(self) -> str:
        """Which way the experts run, and why."""
        if self.refusal is None:
            return "torch._grouped_mm (one kernel for every expert)"
        return f"a loop over the experts: {self.refusal}"

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, h], rows in expert order; counts [num_local] (int64) rows per expert."""
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        listed = counts.tolist() if self._needs_counts else None
        hidden = self._activation(self._matmul(x, getattr(self, self.in_name), offsets, listed))
        return self._matmul(hidden, getattr(self, self.out_name), offsets, listed)
