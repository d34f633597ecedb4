"""The one place that chooses which attention kernel runs.

Each question is answered here, from what is known when a module is built or moved (the config, the device,
whether attention dropout is on, the context-parallel kind); the modules that depend on the device
(`device_choice.ChosenByDevice`) ask again when they move, never per call. What stays per call is each kernel's
own `takes` (dtype, head dim, shape): an input a kernel cannot run goes to the fallback its docstring names.

    question                                      answer                 asked by
    which core attention draws dropout masks      core_kind              core_attention.build_core_attention
    attention_kernel -> the backend on a device   backend_for            core_attention.build_kernel, AutoAttention
    packed documents under SDPA                   choose_document_kernel core_attention.SdpaAttention
    the context-parallel ring's pair kernel       choose_blocks          context_parallel.RingCoreAttention

kernel_paths reports these same answers (the run summary and the self-check), so the report cannot drift.
"""

from __future__ import annotations

import torch

from .document_kernels import PER_DOCUMENT_SDPA, varlen_choice
from .ring_blocks import FLASH_BLOCKS, MATH_BLOCKS, MathBlocks

BACKENDS = ("cpu", "sdpa", "math", "apex")  # core_attention's modules: CpuAttention, SdpaAttention, ...


def core_kind(config) -> str:
    """'layout_invariant' (dropout masks hashed from global coordinates: explicit probabilities in training) when
    config.dropout_rng asks for it and attention dropout is on, else 'tensor_parallel' (the kernel's own dropout
    inside the tensor-parallel generator)."""
    if config.dropout_rng == "layout_invariant" and config.attention_dropout > 0:
        return "layout_invariant"
    return "tensor_parallel"


def backend_for(kernel: str, device) -> str:
    """The backend (one of BACKENDS) that runs attention_kernel `kernel` on `device`: 'auto' is the CPU kernel
    (causal_chunks, SDPA for the rest) on CPU and SDPA elsewhere."""
    if kernel == "auto":
        return "cpu" if torch.device(device).type == "cpu" else "sdpa"
    if kernel in ("sdpa", "math", "apex"):
        return kernel
    raise ValueError(f"unknown attention_kernel {kernel!r}; choose auto, sdpa, math or apex.")


def choose_document_kernel(device, dropout: bool):
    """(kernel, why it was chosen) for packed documents under SDPA on `device`: one varlen_attn call on CUDA
    where this torch and the device have it and attention dropout is off, else one SDPA call per document."""
    if torch.device(device).type != "cuda":
        return PER_DOCUMENT_SDPA, "varlen_attn runs on CUDA only"
    if dropout:
        return PER_DOCUMENT_SDPA, "attention dropout is on and varlen_attn has none"
    if torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 0):  # none under fake tensors
        return PER_DOCUMENT_SDPA, f"FlashAttention-2 needs compute capability 8.0, {device} has less"
    kernel, reason = varlen_choice()
    return (PER_DOCUMENT_SDPA if kernel is None else kernel), reason


def choose_blocks(device: torch.device, kernel: str, dropout: bool) -> MathBlocks:
    """The ring's per-pair kernel for tensors on `device`: its fused flash operators (CPU, CUDA) unless
    attention_kernel='math' or attention dropout is on (its masks need explicit probabilities); MathBlocks
    everywhere else (a device without a row in the operator table)."""
    if kernel == "math" or dropout:
        return MATH_BLOCKS
    return FLASH_BLOCKS.get(torch.device(device).type, MATH_BLOCKS)
