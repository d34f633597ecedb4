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
