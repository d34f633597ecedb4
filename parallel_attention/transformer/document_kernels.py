"""SDPA over packed documents (no mask of the user's): how the SDPA kernel runs a batch's documents, chosen once
from the device (at construction and when the module moves) by `choose_document_kernel`.

    VarlenDocuments     CUDA: torch.nn.attention.varlen.varlen_attn, one FlashAttention-2 call per layer for the
                        whole micro-batch. The batch is packed token-major, [b s, nh, d]; the documents' cumulative
                        lengths (int32) and longest length come from the DocumentLayout, built once per batch on the
                        device; causal is window_size (-1, 0), grouped k/v heads are native. It runs bf16 / fp16
                        (FlashAttention-2's dtypes); a float32 call goes to the per-document loop.
    PerDocumentSdpa     everywhere else (and where varlen_attn is missing, or attention dropout is on: varlen_attn
                        has none): one SDPA call per document, all rows at once when they hold the same documents.

The CPU has its own per-document kernel in front of these (core_attention.CpuAttention, causal_chunks).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch
import torch.nn.functional as F

_VARLEN_DTYPES = (torch.float16, torch.bfloat16)


class PerDocumentSdpa:
    """One SDPA call per document: pairs of documents are never computed."""

    name = "one SDPA call per document"

    def __call__(self, q, k, v, documents, causal: bool, dropout_p: float) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        rows = [slice(None)] if documents.uniform() else [slice(r, r + 1) for r in range(q.shape[0])]
        return torch.cat([torch.cat([F.scaled_dot_product_attention(
            q[row, :, a:e], k[row, :, a:e], v[row, :, a:e], dropout_p=dropout_p, is_causal=causal, enable_gqa=gqa)
            for a, e in documents.spans(i)], dim=2) for i, row in enumerate(rows)], dim=0)


PER_DOCUMENT_SDPA = PerDocumentSdpa()


def _pack(t: torch.Tensor) -> torch.Tensor:
    """[b, n, s, d] -> [b s, n, d]: the batch's tokens one after another, row by row (one copy)."""
    b, n, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, n, d)


class VarlenDocuments:
    """The whole micro-batch in one varlen_attn call (see the module docstring)."""

    name = "torch varlen_attn, one call per layer for the micro-batch (bf16/fp16)"

    def __init__(self, varlen_attn) -> None:
        self.varlen_attn = varlen_attn

    def __call__(self, q, k, v, documents, causal: bool, dropout_p: float) -> torch.Tensor:
        if q.dtype not in _VARLEN_DTYPES:
            return PER_DOCUMENT_SDPA(q, k, v, documents, causal, dropout_p)
        b, nh, s, d = q.shape
        cu, longest = documents.cu_seqlens, documents.max_length
        out = self.varlen_attn(_pack(q), _pack(k), _pack(v), cu, cu, longest, longest,
                               window_size=(-1, 0) if causal else (-1, -1), enable_gqa=nh != k.shape[1])
        return out.view(b, s, nh, d).transpose(1, 2)


VARLEN_MODULE = "torch.nn.attention.varlen"


def varlen_missing_reason() -> str | None:
    """Why this torch has no varlen_attn, or None; looks for the module without importing it (its import registers
    custom operators: seconds, paid only by a module built on CUDA)."""
    if importlib.util.find_spec(VARLEN_MODULE) is None:
        return f"torch {torch.__version__} has no {VARLEN_MODULE} (torch >= 2.10 has)"
    return None


@functools.cache
def _varlen_attn():
    return importlib.import_module(VARLEN_MODULE).varlen_attn


def choose_document_kernel(device, dropout: bool):
    """(kernel, why it was chosen) for packed documents under SDPA on `device`."""
    if torch.device(device).type != "cuda":
        return PER_DOCUMENT_SDPA, "varlen_attn runs on CUDA only"
    if dropout:
        return PER_DOCUMENT_SDPA, "attention dropout is on and varlen_attn has none"
    missing = varlen_missing_reason()
    if missing is not None:
        return PER_DOCUMENT_SDPA, missing
    if torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 0):  # none under fake tensors
        return PER_DOCUMENT_SDPA, f"FlashAttention-2 needs compute capability 8.0, {device} has less"
    return VarlenDocuments(_varlen_attn()), "varlen_attn is available"
