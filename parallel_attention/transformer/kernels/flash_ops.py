"""The fused flash operators of one device, as one table, and the one loop that runs them piece by piece: the
ring's pair kernel (`ring_blocks.FlashBlocks`) and the CPU kernel (`causal_chunks`) both call them through it.

Both devices' operators return the log-sum-exp the ring's merge needs, and their backwards take the final (merged)
output and lse, which is all a ring pair's backward has. Both take grouped k/v heads natively (nkv divides nh), so
k/v are never expanded for them. What differs is a table row:

    device  forward / backward                                             dtypes                  head dim
    cpu     aten._scaled_dot_product_flash_attention_for_cpu[_backward]    fp32, fp64, bf16, fp16  any
    cuda    aten._scaled_dot_product_flash_attention[_backward]            bf16, fp16              <= 256, % 8

Every lse leaves here as one layout: contiguous [b, nh, m] in the accumulation dtype (float32, or float64 for
float64 inputs); the CPU operator returns a [b, m, nh]-strided one, and the CUDA backward reads it contiguous.
Causal alignment: with sq != sk, CUDA's kernel aligns a causal mask bottom-right and the CPU one top-left, so
`is_causal` is only ever passed for a square block (the ring's causal diagonals, the first chunk of the CPU
kernel), and `forward` refuses others. An additive mask (the CPU kernel's later chunks) only the CPU row takes.

`forward_pieces` / `backward_pieces` run a list of `Piece`s (documents.py: rows, query and key ranges, the
kernel's own causal mask or an additive one) into the caller's output, lse and gradient tensors: each piece's
views by narrow (a fake CUDA tensor on a CPU-only torch takes no Python indexing; the CUDA contracts are tested
that way), its output and lse copied (a query row lies in at most one piece), its gradients added in the
caller's dtype and in the caller's order.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

_HALF = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ring merges outputs and sums gradients in: float32 for half inputs, else the input's."""
    return torch.float32 if dtype in _HALF else dtype


def normalized_lse(lse: torch.Tensor, m: int, dtype: torch.dtype) -> torch.Tensor:
    """An operator's lse as the ring keeps it: contiguous [b, nh, m] in the accumulation dtype of `dtype`."""
    return lse.narrow(-1, 0, m).to(accumulation_dtype(dtype)).contiguous()


def _cpu_forward(q, k, v, causal: bool, scale: float | None, mask=None):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                        scale=scale)


def _cpu_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float | None, mask=None):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


def _cuda_forward(q, k, v, causal: bool, scale: float | None, mask=None):
    assert mask is None, "the CUDA flash operator takes no mask: only the CPU kernel's pieces carry one"
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _cuda_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float | None, mask=None):
    """Without dropout the philox seed and offset are never read: empty uint64 tensors of the forward's shapes."""
    assert mask is None, "the CUDA flash operator takes no mask: only the CPU kernel's pieces carry one"
    seed, offset = q.new_empty(2, dtype=torch.uint64), q.new_empty((), dtype=torch.uint64)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal, seed, offset, scale=scale)


# the CUDA operators' arguments as _cuda_forward / _cuda_backward pass them (their schemas in torch 2.11-2.13)
CUDA_ARGUMENTS = {
    "_scaled_dot_product_flash_attention": ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask",
                                            "scale"),
    "_scaled_dot_product_flash_attention_backward": (
        "grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
        "dropout_p", "is_causal", "philox_seed", "philox_offset", "scale"),
}


def schema_problem(arguments: dict[str, tuple[str, ...]], ops=torch.ops.aten) -> str | None:
    """Why this torch's operators cannot be called as written here (missing, or other arguments), or None: read
    from the operators' schemas, never from torch's version string."""
    for name, expected in arguments.items():
        op = getattr(ops, name, None)
        if op is None:
            return f"this torch has no aten.{name}"
        found = tuple(argument.name for argument in op.default._schema.arguments)
        if found != expected:
            return f"this torch's aten.{name} takes ({', '.join(found)}), not ({', '.join(expected)})"
    return None


class FlashOps(NamedTuple):
    """One device's fused flash operators (see the module docstring) and what they take; `problem`: why this
    torch's operators cannot be called (then every pair runs the ring's math), or None."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    head_dims: Callable[[int], bool]
    head_dims_text: str
    raw_forward: Callable
    raw_backward: Callable
    problem: str | None = None

    def takes(self, q: torch.Tensor) -> bool:
        """Whether the operators run q's dtype and head dim (else the ring's math runs the pair)."""
        return self.problem is None and q.dtype in self.dtypes and self.head_dims(q.shape[-1])

    def forward(self, q, k, v, causal: bool, scale: float | None, mask=None):
        """(out [b, nh, sq, d] in q's dtype, lse: `normalized_lse`) of softmax attention, causal on a square only;
        `scale` None: 1 / sqrt(d); `mask`: additive [sq, sk] or None."""
        assert not causal or q.shape[-2] == k.shape[-2], (
            f"is_causal on a {q.shape[-2]} x {k.shape[-2]} block: the CPU and CUDA kernels align it differently")
        out, lse = self.raw_forward(q, k, v, causal, scale, mask)
        return out, normalized_lse(lse, q.shape[-2], q.dtype)

    def backward(self, grad_out, q, k, v, out, lse, causal: bool, scale: float | None, mask=None):
        """(dq, dk, dv) in q's dtype, dk/dv of k/v's own heads, from the final output and lse."""
        return self.raw_backward(grad_out, q, k, v, out, lse.contiguous(), causal, scale, mask)

    def forward_pieces(self, q, k, v, pieces, scale: float | None, out, lse) -> None:
        """Each piece's output and lse written into `out` [b, nh, s, d] and `lse` [b, nh, s] (rows that no piece
        covers keep what the caller put there)."""
        for p in pieces:
            queries, out_part, lse_part = _views((q, out, lse), p.rows, p.q0, p.q1)
            keys, values = _views((k, v), p.rows, p.k0, p.k1)
            o, rows_lse = self.forward(queries, keys, values, p.causal, scale, p.mask)
            out_part.copy_(o)
            lse_part.copy_(rows_lse)
            del o, rows_lse

    def backward_pieces(self, q, k, v, pieces, scale: float | None, grad_out, out, lse, grads) -> None:
        """Each piece's (dq, dk, dv), from its slices of the final output and lse, added into `grads` (dq, dk,
        dv: the caller's dtypes and layouts), piece by piece in the order given."""
        for p in pieces:
            grad_part, queries, out_part, lse_part = _views((grad_out, q, out, lse), p.rows, p.q0, p.q1)
            keys, values = _views((k, v), p.rows, p.k0, p.k1)
            piece_grads = self.backward(grad_part, queries, keys, values, out_part, lse_part, p.causal, scale,
                                        p.mask)
            totals = _views(grads[:1], p.rows, p.q0, p.q1) + _views(grads[1:], p.rows, p.k0, p.k1)
            for total, grad in zip(totals, piece_grads):
                total.add_(grad)
            del piece_grads, grad  # before the next piece's are allocated: a lower peak


def _views(tensors, rows: slice, a: int, b: int) -> list[torch.Tensor]:
    """The views t[rows, :, a:b] of each tensor (dim 2: the sequence of q/k/v [b, n, s, d] and of an lse [b, n, s]),
    by narrow (see the module docstring)."""
    start, stop, _ = rows.indices(tensors[0].shape[0])
    return [t.narrow(0, start, stop - start).narrow(2, a, b - a) for t in tensors]


CPU_FLASH_OPS = FlashOps("aten._scaled_dot_product_flash_attention_for_cpu", (torch.float32, torch.float64, *_HALF),
                         lambda d: True, "any head dim", _cpu_forward, _cpu_backward)
CUDA_FLASH_OPS = FlashOps("aten._scaled_dot_product_flash_attention", _HALF, lambda d: d <= 256 and d % 8 == 0,
                          "head dim <= 256 and a multiple of 8", _cuda_forward, _cuda_backward,
                          schema_problem(CUDA_ARGUMENTS))
