"""The CPU attention kernel (attention_kernel='auto' on CPU): causal self-attention in chunks of query rows, so
that keys the causal mask hides are never computed, on a batch-major copy of q, k and v.

torch's CPU flash kernel (torch 2.13) walks the keys in blocks of up to 512 and skips a block only when the
causal mask hides all of it. At s <= 512 there is one block, so `is_causal=True` costs as much as full
attention: half the work of QK^T, softmax and PV, forward and backward, is spent on masked-out keys.
Split into chunks of `CHUNK_ROWS` queries, chunk i attends keys [0, end_i) only, with a lower-right causal
mask on its last CHUNK_ROWS keys: about (n + 1) / 2n of the work for n chunks.

Measured (one thread, b 2, s 512, d 64, fwd + bwd into the fused QKV gradient, 20 paired rounds;
0.1, in the git history of docs/benchmarks.md): 8 / 8 heads 0.74 of the single call, 8 / 2 heads 0.67, 4 / 1 heads 0.66.
At s 2048, where the kernel already skips whole blocks, chunks were slower (94 against 73 ms), so they stop
at 512 keys. The kernel reads each sample's rows contiguously from a batch-major copy ([b, s, nh, d] in memory):
6-8 % faster forward and backward than from the [s, b, ...] projection output. attention_kernel='sdpa' runs
one SDPA call instead (the kernel of before 0.2, for a run that must continue bit-exactly).

Every row sees the same keys with the same scale, so the values equal the single call's to float rounding
(the kernel sums in other blocks). The chunking depends on s alone, not on the heads a rank holds, so
every tensor-parallel layout computes each head the same way.

Packed documents (`document_attention`, a DocumentLayout of documents.py): the same kernel runs once per
document (each row on its own unless every row holds the same documents), in chunks where a document has
2 * CHUNK_ROWS .. MAX_KEYS tokens: a pair of documents is never computed, so 512-token documents in a
4096-token row cost about 1/8 of the row's causal attention. Each call is a `Piece` (documents.py), and every
query row lies in exactly one; the pieces run through the CPU row of the flash operator table
(`flash_ops.CPU_FLASH_OPS.forward_pieces`), the loop the ring's pairs run too.
"""

from __future__ import annotations

import functools

import torch

from ..documents import Piece
from .flash_ops import CPU_FLASH_OPS, accumulation_dtype

CHUNK_ROWS = 64  # 32-128 measured; 64 was best or tied at s 128-512
MAX_KEYS = 512  # the CPU kernel's key block: beyond it the kernel skips masked blocks itself

_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@functools.cache
def kernel_available() -> bool:
    """Whether this torch has the CPU flash kernel's forward and backward operators (private to torch: another
    version may rename them; then every call takes SDPA)."""
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    except (AttributeError, RuntimeError):
        return False
    return True


def kernel_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> bool:
    """Whether the CPU flash kernel can run these pieces: without dropout (the kernel's dropout draws its masks per
    call: pieces would draw other ones), outside torch.compile, for one floating dtype, the head dimension
    contiguous, nh a multiple of nkv. torch.func's transforms cannot differentiate through the pieces (the
    autograd function keeps the old forward-with-ctx form): use attention_kernel='sdpa' for them."""
    if torch.compiler.is_compiling() or not kernel_available():
        return False
    heads, kv_heads = q.shape[1], k.shape[1]
    return (dropout_p == 0.0 and q.dtype in _KERNEL_DTYPES and q.dtype == k.dtype == v.dtype
            and v.shape[1] == kv_heads and heads % kv_heads == 0  # the operator does not check the grouping
            and all(t.stride(-1) == 1 for t in (q, k, v)))


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> bool:
    """Chunks pay for self-attention of 2 * CHUNK_ROWS .. MAX_KEYS tokens, for the inputs `kernel_takes`."""
    s = q.shape[2]
    return s == k.shape[2] and 2 * CHUNK_ROWS <= s <= MAX_KEYS and kernel_takes(q, k, v, dropout_p)


@functools.lru_cache(maxsize=64)
def _lower_right_causal(rows: int, keys: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [rows, keys]: query row r (global position keys - rows + r) sees keys <= its position."""
    visible = torch.ones(rows, keys, dtype=torch.bool).tril_(diagonal=keys - rows)
    return torch.zeros(rows, keys, dtype=dtype).masked_fill_(~visible, float("-inf"))


def _chunks(s: int) -> list[tuple[int, int]]:
    """(first row, end) of each chunk of query rows; chunk i sees keys [0, end)."""
    return [(start, min(start + CHUNK_ROWS, s)) for start in range(0, s, CHUNK_ROWS)]


def _mask(start: int, end: int, dtype: torch.dtype) -> torch.Tensor | None:
    """None for the first chunk, a square block where the kernel's own (top-left) causal mask is the right one."""
    return None if start == 0 else _lower_right_causal(end - start, end, dtype)


def causal_pieces(rows: slice, first: int, end: int, dtype: torch.dtype) -> list[Piece]:
    """Causal self-attention of tokens [first, end): in chunks of query rows where they pay (2 * CHUNK_ROWS ..
    MAX_KEYS tokens), else one call whose kernel skips the key blocks its causal mask hides."""
    if not 2 * CHUNK_ROWS <= end - first <= MAX_KEYS:
        return [Piece(rows, first, end, first, end, True, None)]
    return [Piece(rows, first + a, first + e, first, first + e, a == 0, _mask(a, e, dtype))
            for a, e in _chunks(end - first)]


class _PiecewiseAttention(torch.autograd.Function):
    """Each piece through torch's CPU flash kernel and its backward (the operators F.scaled_dot_product_attention
    calls on CPU), written into one output: what is kept for backward is what the single call keeps (q, k, v,
    the output, the log-sum-exp rows). Composed from autograd's pieces instead, each would keep its own
    output beside their concatenation, an [s, b, h / p] more per layer, and the slices of k and v would each
    add a zero-filled gradient of k's size in backward. Every query row lies in exactly one piece."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: list[Piece]) -> torch.Tensor:
        q, k, v = (_batch_major(t) for t in (q, k, v))
        b, nh, s, d = q.shape
        out = q.new_empty(b, s, nh, d).transpose(1, 2)  # [b, s, nh, d] in memory, as the single call's
        lse = q.new_empty(b, nh, s, dtype=accumulation_dtype(q.dtype))
        CPU_FLASH_OPS.forward_pieces(q, k, v, pieces, None, out, lse)  # scale None: the operator's 1 / sqrt(d)
        ctx.pieces = pieces
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        b, nh, s, d = q.shape
        # dq starts at -0.0, the exact additive identity (it keeps a gradient's sign of zero): each row lies in
        # one piece, so adding its gradient equals writing it
        grads = q.new_full((b, s, nh, d), -0.0).transpose(1, 2), torch.zeros_like(k), torch.zeros_like(v)
        # last piece first: a causal sequence's last chunk sees every key
        CPU_FLASH_OPS.backward_pieces(q, k, v, ctx.pieces[::-1], None, grad_out, out, lse, grads)
        return *grads, None


def _batch_major(t: torch.Tensor) -> torch.Tensor:
    """t [b, heads, s, d] copied, same shape and values, laid out in memory as [b, s, heads, d]."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def chunked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(d)) v for q [b, nh, s, d], k and v [b, nkv, s, d] (nh a multiple of nkv:
    the kernel maps query head i to k/v head i // (nh / nkv)); returns [b, nh, s, d], laid out [b, s, nh, d]
    in memory as the single kernel call returns it for the attention module's inputs."""
    return _PiecewiseAttention.apply(q, k, v, causal_pieces(slice(None), 0, q.shape[2], q.dtype))


def document_pieces(documents, causal: bool, dtype: torch.dtype) -> list[Piece]:
    """The pieces of attention within each document of a `DocumentLayout` (documents.py): every row at once when
    the rows hold the same documents, else row by row. Pairs of documents are never computed."""
    pieces = []
    for row, spans in documents.row_groups():
        for first, end in spans:
            pieces += causal_pieces(row, first, end, dtype) if causal else [Piece(row, first, end, first, end, False)]
    return pieces


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents, causal: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v within each document of `documents` (causal or not), for the inputs
    `kernel_takes`; returns [b, nh, s, d] laid out [b, s, nh, d], as chunked_causal_attention."""
    return _PiecewiseAttention.apply(q, k, v, document_pieces(documents, causal, q.dtype))
