"""Lazy access to NVIDIA apex's fused kernels, with the reason when they are unavailable.

NVIDIA apex is not on PyPI (the PyPI package called `apex` is an unrelated web toolkit), so
it is only ever found where it was built from source, as in NGC containers. Nothing here
imports apex until asked.
"""

from __future__ import annotations

import functools
import importlib


@functools.lru_cache(maxsize=None)
def _apex_module(name: str):
    """apex's module `name`, or None when NVIDIA apex is not installed."""
    try:
        return importlib.import_module(name)
    except Exception:  # ImportError, or an unrelated `apex` package without this module
        return None


def fused_softmax_module():
    """apex.transformer.functional.fused_softmax, or None."""
    return _apex_module("apex.transformer.functional.fused_softmax")


def fused_norms_module():
    """apex.normalization.fused_layer_norm (fused LayerNorm and RMSNorm on CUDA), or None."""
    return _apex_module("apex.normalization.fused_layer_norm")


def apex_available() -> bool:
    return fused_softmax_module() is not None


def active_paths() -> dict[str, str]:
    """Which implementation each kernel family uses in this environment (for logs and README)."""
    import torch

    from . import causal_chunks

    cpu = "torch SDPA"
    if causal_chunks.kernel_available():
        rows = causal_chunks.CHUNK_ROWS
        cpu += (f"; causal self-attention of {2 * rows}-{causal_chunks.MAX_KEYS} tokens in chunks of {rows} query "
                "rows (the CPU kernel)")
    return {
        "attention on CUDA (attention_kernel='auto'/'sdpa')": "torch SDPA (flash / memory-efficient kernels)"
        if torch.cuda.is_available() else "torch SDPA (no CUDA device here)",
        "attention on CPU (attention_kernel='auto')": cpu,
        "attention (attention_kernel='apex')": "apex fused scale-mask-softmax" if apex_available()
        else "unavailable: NVIDIA apex is not installed",
    }
