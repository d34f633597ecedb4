"""Local attention on this rank's heads: one class per backend, chosen once at construction (`choice`).

Every backend takes q [b, nh, s, d], k and v [b, nkv, s, d] (nh a multiple of nkv; query head
i uses k/v head i // (nh / nkv)), an optional boolean mask broadcastable to [b, 1, s, s] (True:
may attend), the causal flag and the dropout probability, and returns [b, nh, s, d]. A query
row with no key to attend outputs zeros in every backend. `documents` (a DocumentLayout, documents.py, or
None): attention stays inside each packed document; the CPU kernel runs per document, SDPA (without a user mask)
its document kernel (document_kernels.py: one varlen_attn call on CUDA, else per document), both skipping the
rest; math, apex and layout-invariant dropout take the documents as an explicit mask.

`build_core_attention` picks how attention dropout draws its masks (`dropout_rng`), once:
`CoreAttention` runs the kernel inside the tensor-parallel generator; `LayoutInvariantCoreAttention`
computes explicit probabilities in training and drops them with a mask hashed from the global
coordinates (sample, head, query, key), so every layout drops the same probabilities.
With `recompute=True` (model.recompute_granularity='selective') it wraps either in
`RecomputedCoreAttention`: softmax(q k^T) v is recomputed in backward, its dropout masks replayed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...tensor_parallel.dropout_hash import as_key
from ...tensor_parallel.rng import checkpoint_with_tp_rng, current_dropout_coordinates, tensor_parallel_rng
from . import causal_chunks
from .apex_kernels import fused_softmax_module
from ..attention_config import AttentionConfig
from .choice import backend_for, choose_document_kernel, core_kind
from .device_choice import ChosenByDevice
from .kv_groups import repeat_kv
from ..dropout import DropoutSite, hashed_dropout


def combine_masks(mask: torch.Tensor | None, causal: bool, s: int, device) -> torch.Tensor | None:
    """AND of the user's mask and the causal (lower-triangular) mask; None when neither."""
    if not causal:
        return mask
    tril = torch.ones(s, s, dtype=torch.bool, device=device).tril_()
    return tril if mask is None else mask & tril


def with_documents(mask: torch.Tensor | None, causal: bool, documents) -> torch.Tensor | None:
    """The user's mask AND the documents' (a DocumentLayout, documents.py; causal included), for a kernel that
    cannot skip what the documents hide; `mask` itself without documents."""
    return mask if documents is None else documents.combine(mask, causal)


class SdpaAttention(ChosenByDevice):
    """torch.nn.functional.scaled_dot_product_attention, one call: flash / memory-efficient on CUDA. With
    documents and no mask of the user's, the document kernel chosen for the device (document_kernels.py: one
    varlen_attn call on CUDA, else one SDPA call per document); `dropout`: attention dropout is on."""

    def __init__(self, device=None, dropout: bool = False) -> None:
        super().__init__(device)
        self.dropout = dropout
        self._choose()

    def _choose(self) -> None:
        self.documents_kernel, self.documents_reason = choose_document_kernel(self.device, self.dropout)

    def forward(self, q, k, v, mask, causal: bool, dropout_p: float, documents=None) -> torch.Tensor:
        if documents is not None and mask is None:
            return self.documents_kernel(q, k, v, documents, causal, dropout_p)
        gqa = q.shape[1] != k.shape[1]
        mask = with_documents(mask, causal, documents)
        if mask is None:  # the is_causal fast path keeps flash attention eligible
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, enable_gqa=gqa)
        mask = combine_masks(mask, causal, q.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


class CpuAttention(SdpaAttention):
    """The CPU kernel: causal self-attention of 128-512 tokens without a mask in chunks of query rows, on a
    batch-major copy (causal_chunks.py); with documents and no mask, the same kernel per document (chunked where
    it pays); everything else as SdpaAttention."""

    def forward(self, q, k, v, mask, causal: bool, dropout_p: float, documents=None) -> torch.Tensor:
        if mask is None and documents is not None and causal_chunks.kernel_takes(q, k, v, dropout_p):
            return causal_chunks.document_attention(q, k, v, documents, causal)
        if mask is None and documents is None and causal and causal_chunks.applies(q, k, v, dropout_p):
            return causal_chunks.chunked_causal_attention(q, k, v)
        return super().forward(q, k, v, mask, causal, dropout_p, documents)


class AutoAttention(ChosenByDevice):
    """attention_kernel='auto': CpuAttention on CPU, SdpaAttention elsewhere. Chosen at construction from the
    device, and again when the module moves (`.to`, `.cuda`): never per call."""

    def __init__(self, device=None, dropout: bool = False) -> None:
        super().__init__(device)
        self.dropout = dropout
        self._choose()

    def _choose(self) -> None:
        self.kernel = _backend(backend_for("auto", self.device), self.device, self.dropout)

    def forward(self, q, k, v, mask, causal: bool, dropout_p: float, documents=None) -> torch.Tensor:
        return self.kernel(q, k, v, mask, causal, dropout_p, documents)


def attention_probs(q: torch.Tensor, k: torch.Tensor, mask, causal: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) [b, nh, s_q, s_k] for k already expanded to q's heads; softmax in
    float32 for half-precision inputs; rows with nothing to attend are zeros, not NaN."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    mask = combine_masks(mask, causal, q.shape[2], q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    softmax_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(q.dtype)
    if mask is not None:
        probs = probs.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    return probs


class MathAttention(nn.Module):
    """Explicit softmax(q k^T / sqrt(d)) v; softmax in float32 for half-precision inputs; documents as a mask."""

    def forward(self, q, k, v, mask, causal: bool, dropout_p: float, documents=None) -> torch.Tensor:
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        probs = attention_probs(q, k, with_documents(mask, causal, documents), causal)
        if dropout_p > 0:
            probs = F.dropout(probs, p=dropout_p)
        return torch.matmul(probs, v)


class ApexFusedSoftmaxAttention(nn.Module):
    """apex's fused scale-mask-softmax kernels (fp16/bf16 on CUDA) between two matmuls.

    apex falls back to torch's softmax itself where its kernels do not apply (fp32 inputs,
    unsupported sizes).
    """

    def __init__(self) -> None:
        super().__init__()
        fused = fused_softmax_module()
        if fused is None:
            raise ValueError("attention_kernel='apex' but NVIDIA apex is not installed: use attention_kernel='auto'.")
        self._fused = fused
        self._softmax: dict[tuple, nn.Module] = {}

    def _kernel(self, dtype: torch.dtype, causal_only: bool, scale: float) -> nn.Module:
        key = (dtype, causal_only, scale)
        if key not in self._softmax:
            from apex.transformer.enums import AttnMaskType

            self._softmax[key] = self._fused.FusedScaleMaskSoftmax(
                dtype == torch.float16, dtype == torch.bfloat16,
                AttnMaskType.causal if causal_only else AttnMaskType.padding,
                True, lambda scores, masked_out: scores.masked_fill(masked_out, -10000.0), True, scale,
            )
        return self._softmax[key]

    def forward(self, q, k, v, mask, causal: bool, dropout_p: float, documents=None) -> torch.Tensor:
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = torch.matmul(q, k.transpose(-1, -2))
        mask = with_documents(mask, causal, documents)  # documents: the padding kind, as an explicit mask
        causal_only = causal and mask is None
        mask = combine_masks(mask, causal, q.shape[2], q.device)
        masked_out = None if causal_only or mask is None else ~mask.expand(q.shape[0], 1, -1, -1)
        probs = self._kernel(q.dtype, causal_only, scale)(scores, masked_out)
        if masked_out is not None:  # apex's -10000 fill leaves fully masked rows uniform: zero them
            probs = probs.masked_fill(masked_out.all(dim=-1, keepdim=True), 0.0)
        if dropout_p > 0:
            probs = F.dropout(probs, p=dropout_p)
        return torch.matmul(probs, v)


def _backend(name: str, device, dropout: bool) -> nn.Module:
    """The module of backend `name` (choice.BACKENDS)."""
    if name == "cpu":
        return CpuAttention(device, dropout)
    if name == "sdpa":
        return SdpaAttention(device, dropout)
    return MathAttention() if name == "math" else ApexFusedSoftmaxAttention()


def build_kernel(kernel: str, device=None, dropout: bool = False) -> nn.Module:
    """The kernel's module for tensors on `device` (None: torch's default device), the backend `choice.backend_for`
    names; 'auto' chooses again when the module moves. `dropout`: attention dropout is on (SDPA's document kernel
    then keeps one call per document)."""
    if kernel == "auto":
        return AutoAttention(device, dropout)
    return _backend(backend_for(kernel, device), device, dropout)


class CoreAttention(nn.Module):
    """The chosen kernel, with attention dropout drawn from the tensor-parallel generator.

    Each rank holds other heads, so their dropout masks must differ across the group: the kernel
    runs inside `tensor_parallel_rng` when dropout is on (decided here, once) and in training mode.
    """

    def __init__(self, kernel: str, dropout_p: float = 0.0, device=None) -> None:
        super().__init__()
        self.kernel, self.dropout_p = build_kernel(kernel, device, dropout_p > 0), dropout_p
        self._attend = self._attend_with_dropout if dropout_p > 0 else self._attend_without_dropout

    def forward(self, q, k, v, mask: torch.Tensor | None, causal: bool, documents=None) -> torch.Tensor:
        """`documents`: the batch's DocumentLayout (documents.py) or None: attention never crosses a document."""
        return self._attend(q, k, v, mask, causal, documents)

    def _attend_without_dropout(self, q, k, v, mask, causal: bool, documents=None) -> torch.Tensor:
        return self.kernel(q, k, v, mask, causal, 0.0, documents)

    def _attend_with_dropout(self, q, k, v, mask, causal: bool, documents=None) -> torch.Tensor:
        if not self.training:
            return self._attend_without_dropout(q, k, v, mask, causal, documents)
        with tensor_parallel_rng(q.device):
            return self.kernel(q, k, v, mask, causal, self.dropout_p, documents)


class LayoutInvariantCoreAttention(CoreAttention):
    """Attention dropout whose mask depends on (seed, step, sample, layer, global head, query, key) only.

    In training the probabilities are explicit (the math path: SDPA cannot take a dropout mask) and this
    rank hashes the mask of its own heads, global heads head_offset .. head_offset + nh/p - 1 of
    `num_heads`; outside training the chosen kernel runs without dropout.
    """

    def __init__(self, kernel: str, dropout_p: float, num_heads: int, head_offset: int, layer: int,
                 device=None) -> None:
        super().__init__(kernel, dropout_p, device)
        self.num_heads, self.head_offset, self.layer = num_heads, head_offset, layer
        self.layer_word = as_key(layer)  # hashed as a tensor: one torch.compile graph serves every layer

    def _attend_with_dropout(self, q, k, v, mask, causal: bool, documents=None) -> torch.Tensor:
        if not self.training:
            return self._attend_without_dropout(q, k, v, mask, causal, documents)
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        probs = attention_probs(q, k, with_documents(mask, causal, documents), causal)
        b, nh_local, s_q, s_k = probs.shape
        coords = current_dropout_coordinates()
        axes = [(coords.first_sample_tensor, b, self.num_heads * s_q * s_k), (self.head_offset, nh_local, s_q * s_k),
                (0, s_q, s_k), (0, s_k, 1)]
        keep = coords.keep_mask(self.dropout_p, self.layer_word, DropoutSite.ATTENTION_PROBS, axes, q.device)
        return torch.matmul(hashed_dropout(probs, keep, self.dropout_p), v)


class RecomputedCoreAttention(nn.Module):
    """Selective recomputation (Korthikanti et al. 2022): keep q, k, v (the projections' outputs), drop what
    the kernel saves (the s x s probabilities and dropout masks of the math path; SDPA's output and logsumexp)
    and recompute it in backward. The tensor-parallel generator and the dropout coordinates are replayed,
    so dropout draws the same masks (`checkpoint_with_tp_rng`, as full-layer recomputation does)."""

    def __init__(self, core: CoreAttention) -> None:
        super().__init__()
        self.core = core

    def forward(self, q, k, v, mask: torch.Tensor | None, causal: bool, documents=None) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()):  # nothing to save: run it plainly
            return self.core(q, k, v, mask, causal, documents)
        return checkpoint_with_tp_rng(self.core, q, k, v, mask, causal, documents)


def build_core_attention(config: AttentionConfig, head_offset: int, layer: int,
                         recompute: bool = False, device=None) -> nn.Module:
    """The core attention `config.dropout_rng` asks for; `head_offset` is this rank's first global head;
    `recompute`: recomputed in backward (selective recomputation)."""
    if core_kind(config) == "layout_invariant":
        core = LayoutInvariantCoreAttention(config.attention_kernel, config.attention_dropout, config.num_heads,
                                            head_offset, layer, device)
    else:
        core = CoreAttention(config.attention_kernel, config.attention_dropout, device)
    return RecomputedCoreAttention(core) if recompute else core
