"""What each attention path runs in this environment, on CPU and on CUDA, and why (for logs, the self-check and
the README): read from the same choices the modules make at construction, so it cannot drift from them."""

from __future__ import annotations

import torch

from . import causal_chunks
from .apex_kernels import apex_available
from .document_kernels import PER_DOCUMENT_SDPA, VarlenDocuments, varlen_choice, varlen_missing_reason
from .choice import choose_blocks


def _cpu_attention() -> str:
    cpu = "torch SDPA"
    if causal_chunks.kernel_available():
        rows = causal_chunks.CHUNK_ROWS
        cpu += (f"; causal self-attention of {2 * rows}-{causal_chunks.MAX_KEYS} tokens in chunks of {rows} query "
                "rows (the CPU kernel)")
    return cpu


def _ring_pairs(device: str) -> str:
    blocks = choose_blocks(torch.device(device), "auto", dropout=False)
    if blocks.ops.problem is not None:
        return f"explicit-lse math ({blocks.ops.problem})"
    dtypes = ", ".join(str(d).removeprefix("torch.") for d in blocks.ops.dtypes)
    return (f"{blocks.name} for {dtypes}, {blocks.ops.head_dims_text}; explicit-lse math otherwise, with attention "
            "dropout or attention_kernel='math'")


def _documents_on_cuda() -> str:
    """What a module built on CUDA chooses for packed documents. The signature of varlen_attn is read where CUDA
    is (importing its module takes a second or two, which a CPU-only process never pays)."""
    missing = varlen_missing_reason()
    if missing is not None:
        return f"{PER_DOCUMENT_SDPA.name} ({missing})"
    if not torch.cuda.is_available():
        return f"{VarlenDocuments.name}, as its signature allows (read on a machine with CUDA)"
    varlen, why = varlen_choice()
    return (VarlenDocuments.name + why.removeprefix("varlen_attn is available") if varlen is not None
            else f"{PER_DOCUMENT_SDPA.name} ({why})")


def active_paths() -> dict[str, str]:
    """Which implementation each kernel family uses in this environment, and why."""
    documents = _documents_on_cuda()
    return {
        "attention on CUDA (attention_kernel='auto'/'sdpa')": "torch SDPA (flash / memory-efficient kernels)"
        if torch.cuda.is_available() else "torch SDPA (no CUDA device here)",
        "attention on CPU (attention_kernel='auto')": _cpu_attention(),
        "packed documents on CUDA (attention_kernel='auto'/'sdpa', no attention_mask)": documents
        + "; one SDPA call per document in float32, at a head dim above 256 or not a multiple of 8, or with "
        "attention dropout",
        "packed documents on CPU (attention_kernel='auto')": "the CPU kernel once per document (causal_chunks)",
        "ring pairs on CUDA (context_parallel_kind='ring')": _ring_pairs("cuda"),
        "ring pairs on CPU (context_parallel_kind='ring')": _ring_pairs("cpu"),
        "attention (attention_kernel='apex')": "apex fused scale-mask-softmax" if apex_available()
        else "unavailable: NVIDIA apex is not installed",
    }
