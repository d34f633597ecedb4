"""SDPA over packed documents (no mask of the user's): how the SDPA kernel runs a batch's documents, chosen once
from the device (at construction and when the module moves) by `choice.choose_document_kernel`.

    VarlenDocuments     CUDA: torch.nn.attention.varlen.varlen_attn, one FlashAttention-2 call per layer for the
                        whole micro-batch. The batch is packed token-major, [b s, nh, d]; the documents' cumulative
                        lengths (int32) and longest length come from the DocumentLayout, built once per batch on the
                        device. It runs what FlashAttention-2 takes, bf16 / fp16 at a head dim <= 256 and a multiple
                        of 8; any other call goes to the per-document loop.
    PerDocumentSdpa     everywhere else (and where varlen_attn is missing, or attention dropout is on: varlen_attn
                        has none): one SDPA call per document, all rows at once when they hold the same documents.

The CPU has its own per-document kernel in front of these (core_attention.CpuAttention, causal_chunks).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect

import torch
import torch.nn.functional as F

_VARLEN_DTYPES = (torch.float16, torch.bfloat16)


class PerDocumentSdpa:
    """One SDPA call per document: pairs of documents are never computed."""

    name = "one SDPA call per document"

    def __call__(self, q, k, v, documents, causal: bool, dropout_p: float) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        return torch.cat([torch.cat([F.scaled_dot_product_attention(
            q[row, :, a:e], k[row, :, a:e], v[row, :, a:e], dropout_p=dropout_p, is_causal=causal, enable_gqa=gqa)
            for a, e in spans], dim=2) for row, spans in documents.row_groups()], dim=0)


PER_DOCUMENT_SDPA = PerDocumentSdpa()


def _pack(t: torch.Tensor) -> torch.Tensor:
    """[b, n, s, d] -> [b s, n, d]: the batch's tokens one after another, row by row (one copy)."""
    b, n, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, n, d)


def _window(causal: bool) -> dict:
    return {"window_size": (-1, 0) if causal else (-1, -1)}


def _is_causal(causal: bool) -> dict:
    return {"is_causal": causal}


def _grouped_heads(q, k) -> dict:
    return {"enable_gqa": q.shape[1] != k.shape[1]}


def _heads_as_they_are(q, k) -> dict:
    return {}


def varlen_takes(q: torch.Tensor) -> bool:
    """Whether FlashAttention-2 (varlen_attn) runs q's dtype and head dim."""
    return q.dtype in _VARLEN_DTYPES and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


class VarlenDocuments:
    """The whole micro-batch in one varlen_attn call (see the module docstring). How causal and grouped heads are
    passed is this torch's signature (`varlen_kernel`): window_size (2.11 on) or is_causal; enable_gqa where the
    wrapper has it (2.13 on: it refuses grouped k/v without it). Grouped k/v go to the call as they are, never
    repeated to the query heads: FlashAttention-2's varlen kernel reads query head i's k/v from head
    i // (nh / nkv), and a wrapper without enable_gqa (2.11) checks no head counts. gpu_check's probe step proves
    it on the device (equal to the repeated call, forward and backward)."""

    name = "torch varlen_attn, one call per layer for the micro-batch (bf16/fp16, head dim <= 256 and % 8)"

    def __init__(self, varlen_attn, window_size: bool = True, enable_gqa: bool = True) -> None:
        self.varlen_attn = varlen_attn
        self._causal = _window if window_size else _is_causal
        self._groups = _grouped_heads if enable_gqa else _heads_as_they_are

    def __call__(self, q, k, v, documents, causal: bool, dropout_p: float) -> torch.Tensor:
        if not varlen_takes(q):
            return PER_DOCUMENT_SDPA(q, k, v, documents, causal, dropout_p)
        b, nh, s, d = q.shape
        cu, longest = documents.cu_seqlens, documents.max_length
        out = self.varlen_attn(_pack(q), _pack(k), _pack(v), cu, cu, longest, longest, **self._causal(causal),
                               **self._groups(q, k))
        return out.view(b, s, nh, d).transpose(1, 2)


def varlen_kernel(varlen_attn) -> tuple[VarlenDocuments | None, str]:
    """(the kernel calling `varlen_attn` as its signature asks, why), or (None, why not): read by signature, never
    by torch's version string, so a backport or a nightly is called as it is."""
    params = inspect.signature(varlen_attn).parameters
    if "window_size" not in params and "is_causal" not in params:
        return None, f"this torch's varlen_attn{inspect.signature(varlen_attn)} takes neither window_size nor is_causal"
    gqa = "enable_gqa" in params
    kernel = VarlenDocuments(varlen_attn, window_size="window_size" in params, enable_gqa=gqa)
    return kernel, "varlen_attn is available" + ("" if gqa else (
        " (it takes no enable_gqa and checks no head counts: grouped k/v heads reach it as they are)"))


VARLEN_MODULE = "torch.nn.attention.varlen"


def varlen_missing_reason() -> str | None:
    """Why this torch has no varlen_attn, or None; looks for the module without importing it."""
    if importlib.util.find_spec(VARLEN_MODULE) is None:
        return f"torch {torch.__version__} has no {VARLEN_MODULE} (torch >= 2.10 has)"
    return None


@functools.cache
def _varlen_module():
    return importlib.import_module(VARLEN_MODULE)


def varlen_choice() -> tuple[VarlenDocuments | None, str]:
    """What this torch offers packed documents on CUDA, whatever the device here: (kernel, why) or (None, why not).
    Imports the module when it exists (about a second: its custom operators register)."""
    missing = varlen_missing_reason()
    return (None, missing) if missing is not None else varlen_kernel(_varlen_module().varlen_attn)
