"""The ring's per-pair kernels: one block pair's partial attention with its log-sum-exp, and that pair's backward.

Both take q [b, nhl, m, d] (one half of this rank's part), k, v [b, nkvl, m, d] (k/v with their own heads) and a
`Pair` (its mask, and whether it is the causal diagonal). Each returns the pair's output with its lse in the
accumulation dtype (`flash_ops.accumulation_dtype`: float32 for half inputs), and gradients the ring sums in that
dtype. Chosen once by the ring's module (`choice.choose_blocks`, by device, at construction and when the module moves):

    FlashBlocks     the device's fused flash operators (`flash_ops`: a table of two rows, CPU and CUDA; one code
                    path), for the pairs they can run: no mask, the causal diagonal (is_causal on the square m x m
                    block), or a pair partly masked by documents, as one call per document present in both halves
                    (the pair's `pieces`: each fully visible or a causal diagonal square; every query row lies in
                    at most one, rows in none give out 0 and lse -inf, as the math). A dtype or head dim the
                    operators refuse (fp32 on CUDA, a head dim over 256) runs as MathBlocks.
                    Measured on this host, one pair m 1024, 4 heads, d 32, fp32, one thread, forward + backward:
                    80 ms against math's 194 (full), 55 against 269 (diagonal).
    MathBlocks      explicit-lse torch math (k/v expanded to the query heads here only): scores, lse = logsumexp,
                    exp(scores - lse) v; any mask, and the dropout of `ring_dropout` on the probabilities. Backward
                    from the final lse and delta = rowsum(dO o O): P = exp(S - lse), dV = P_d^T dO,
                    dS = P o (drop(dO V^T) - delta). Softmax statistics in the accumulation dtype.

Documents on CUDA: the pieces call the flash operator per document sub-pair, as on CPU, rather than one varlen call
per pair: the ring needs the backward from the *merged* output and lse, which torch's flash backward takes and
varlen_attn's autograd-only backward does not.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .flash_ops import CPU_FLASH_OPS, CUDA_FLASH_OPS, FlashOps, accumulation_dtype
from .kv_groups import repeat_kv, sum_kv_groups


class Pair(NamedTuple):
    """One (q half, k half) pair of a ring step: indices into this rank's halves and the k/v part in hand."""

    i: int
    j: int
    # bool broadcastable to [b, nh, m, m], for the kernels that read one (`reads_masks`); None: every key visible,
    # or a pair the flash operators run whole from `diagonal` or `pieces` (the ring builds no mask for them)
    mask: torch.Tensor | None
    chunks: tuple[int, int]  # (q chunk, k chunk) of the 2 cp chunks: the global rows and columns of the block
    diagonal: bool  # the causal diagonal block (mask: lower-triangular), without documents
    pieces: tuple | None = None  # with documents: the per-document sub-pairs (DocumentLayout.block_pieces)


def _scores(q, k, mask, scale):
    scores = (torch.matmul(q, k.transpose(-1, -2)) * scale).to(accumulation_dtype(q.dtype))
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # rows that see nothing: probabilities 0


class MathBlocks:
    """Explicit-lse torch math (see the module docstring); `drop` applies the pair's dropout (or nothing)."""

    name = "explicit-lse math"

    def reads_masks(self, q: torch.Tensor) -> bool:
        """Whether the pairs of `q` need their masks built: the math does."""
        return True

    def forward(self, q, k, v, pair: Pair, scale: float, drop):
        """The pair's output (probabilities dropped by `drop`) and the log-sum-exp of its undropped scores."""
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        scores = _scores(q, k, pair.mask, scale)
        lse = torch.logsumexp(scores, dim=-1)
        probs = drop(torch.exp(scores - finite(lse).unsqueeze(-1)))
        return torch.matmul(probs.to(v.dtype), v), lse

    def backward(self, q, k, v, pair: Pair, scale: float, drop, grad_out, out, lse, delta):
        """(dq, dk, dv) of the pair, from the final output's lse and delta = rowsum(dO o O)."""
        heads = k.shape[1]
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        p = torch.exp(_scores(q, k, pair.mask, scale) - finite(lse).unsqueeze(-1))
        dv = torch.matmul(drop(p).to(q.dtype).transpose(-1, -2), grad_out)
        dp = torch.matmul(grad_out, v.transpose(-1, -2)).to(p.dtype)
        ds = (p * (drop(dp) - delta.unsqueeze(-1))).to(q.dtype)
        dk = torch.matmul(ds.transpose(-1, -2), q) * scale
        return torch.matmul(ds, k) * scale, sum_kv_groups(dk, heads), sum_kv_groups(dv, heads)


class FlashBlocks(MathBlocks):
    """One device's fused flash operators (`ops`) for the pairs they take (see the module docstring); MathBlocks
    otherwise. Built only for a ring without attention dropout."""

    def __init__(self, ops: FlashOps) -> None:
        self.ops, self.name = ops, ops.name

    def reads_masks(self, q: torch.Tensor) -> bool:
        """Only where the operators refuse q's dtype or head dim (the pairs then run as math): a ring pair is full,
        the causal diagonal or documents' pieces, which the operators run without a mask."""
        return not self.ops.takes(q)

    def _takes(self, q, pair: Pair) -> bool:
        return (pair.mask is None or pair.diagonal or pair.pieces is not None) and self.ops.takes(q)

    def forward(self, q, k, v, pair: Pair, scale: float, drop):
        if not self._takes(q, pair):
            return super().forward(q, k, v, pair, scale, drop)
        if pair.pieces is not None:
            return self._pieces_forward(q, k, v, pair.pieces, scale)
        return self.ops.forward(q, k, v, pair.diagonal, scale)

    def backward(self, q, k, v, pair: Pair, scale: float, drop, grad_out, out, lse, delta):
        if not self._takes(q, pair):
            return super().backward(q, k, v, pair, scale, drop, grad_out, out, lse, delta)
        if pair.pieces is not None:
            return self._pieces_backward(q, k, v, pair.pieces, scale, grad_out, out, lse)
        return self.ops.backward(grad_out, q, k, v, out, lse, pair.diagonal, scale)

    def _pieces_forward(self, q, k, v, pieces, scale: float):
        """A documents-masked pair, one fused call per document sub-pair (a `Piece`, documents.py); rows that no
        piece covers see no key: out 0, lse -inf."""
        out = torch.zeros_like(q)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=accumulation_dtype(q.dtype))
        self.ops.forward_pieces(q, k, v, pieces, scale, out, lse)
        return out, lse

    def _pieces_backward(self, q, k, v, pieces, scale: float, grad_out, out, lse):
        """(dq, dk, dv) of _pieces_forward's pair, summed in the accumulation dtype."""
        grads = tuple(torch.zeros_like(t, dtype=accumulation_dtype(t.dtype)) for t in (q, k, v))
        self.ops.backward_pieces(q, k, v, pieces, scale, grad_out, out, lse, grads)
        return grads


class CpuFlashBlocks(FlashBlocks):
    """FlashBlocks over the CPU row of the operator table."""

    def __init__(self) -> None:
        super().__init__(CPU_FLASH_OPS)


class CudaFlashBlocks(FlashBlocks):
    """FlashBlocks over the CUDA row of the operator table (bf16 / fp16; fp32 pairs run as MathBlocks)."""

    def __init__(self) -> None:
        super().__init__(CUDA_FLASH_OPS)


MATH_BLOCKS, CPU_FLASH_BLOCKS, CUDA_FLASH_BLOCKS = MathBlocks(), CpuFlashBlocks(), CudaFlashBlocks()
FLASH_BLOCKS = {"cpu": CPU_FLASH_BLOCKS, "cuda": CUDA_FLASH_BLOCKS}  # the device types with a row in flash_ops
