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

    from ..tensor_parallel import shm_all_reduce
    from ..tensor_parallel.gemm import onednn_linear_active
    from . import causal_chunks

    sdpa = "torch SDPA (flash / memory-efficient kernels)" if torch.cuda.is_available() else "torch SDPA (CPU)"
    if causal_chunks.requested():
        rows = causal_chunks.CHUNK_ROWS
        sdpa += (f"; on CPU, causal self-attention of {2 * rows}-{causal_chunks.MAX_KEYS} tokens in chunks of "
                 f"{rows} query rows")
    return {
        "attention (attention_kernel='auto'/'sdpa')": sdpa,
        "attention (attention_kernel='apex')": "apex fused scale-mask-softmax" if apex_available()
        else "unavailable: NVIDIA apex is not installed",
        "linear GEMMs (float32 on CPU)": "oneDNN inner product (forward and input gradient), torch's for the weight "
        "gradient" if onednn_linear_active() else "torch's (MKL / BLAS; PARALLEL_ATTENTION_ONEDNN_LINEAR=1 for oneDNN's)",
        "sum all-reduce (gloo groups on one host)": "shared memory (PARALLEL_ATTENTION_SHM_ALL_REDUCE=1)"
        if shm_all_reduce.requested() and shm_all_reduce.machine_supported()
        else "gloo's (set PARALLEL_ATTENTION_SHM_ALL_REDUCE=1 for shared memory)",
    }
