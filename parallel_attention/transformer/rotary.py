"""Rotary position embedding, rotate-half form (GPT-NeoX; Llama in Hugging Face format).

Over the whole head dim d: frequencies theta^(-2i/d) for i < d/2, duplicated, so that element
j and j + d/2 rotate together. Computed in float32 (float64 for float64 inputs), like the
Hugging Face reference, then cast to the input dtype.

Frequency scaling (`RopeScaling`, rope_type in ROPE_TYPES):
    default  the frequencies as above
    llama3   Llama 3.1's: with wavelength w_i = 2 pi / f_i and L the original context length,
             w_i < L / high_freq_factor: f_i kept;  w_i > L / low_freq_factor: f_i / factor;
             between: (1 - a) f_i / factor + a f_i,  a = (L / w_i - low) / (high - low)
Other kinds (linear, dynamic, yarn, longrope, ...) are refused by name.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are rescaled (rope_type 'default': not at all; the numbers are unused)."""

    rope_type: str = "default"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self) -> None:
        check_rope_type(self.rope_type, "rope_type")
        if self.rope_type == "default":
            return
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"rope scaling: {name}={value!r} (model.rope_{name}) must be a positive number.")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"rope scaling: high_freq_factor={self.high_freq_factor} must exceed low_freq_factor="
                             f"{self.low_freq_factor} (llama3 interpolates between the two wavelengths): raise "
                             "model.rope_high_freq_factor or lower model.rope_low_freq_factor.")
        value = self.original_max_seq_len
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"rope scaling: original_max_seq_len={value!r} (model.rope_original_max_seq_len) must "
                             "be a positive integer.")


def check_rope_type(rope_type, where: str) -> None:
    """ValueError naming `rope_type` and what is supported, unless it is one of ROPE_TYPES."""
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}={rope_type!r} is not supported: the rotary embedding implements rope_type "
                         f"{' and '.join(repr(t) for t in ROPE_TYPES)} (linear, dynamic, yarn and longrope are not "
                         "implemented).")


def default_frequencies(head_dim: int, theta: float, device, dtype: torch.dtype) -> torch.Tensor:
    """The d/2 unscaled rotary frequencies theta^(-2i/d)."""
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64)
    return 1.0 / (theta ** (exponent.to(dtype) / head_dim))


def unscaled(inv_freq: torch.Tensor) -> torch.Tensor:
    return inv_freq


def llama3_scaled(scaling: RopeScaling, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1's frequency scaling (see the module docstring)."""
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    context = scaling.original_max_seq_len
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < context / high) * ~(wavelength > context / low)
    return torch.where(medium, smoothed, scaled)


def frequency_scaling(scaling: RopeScaling | None):
    """The function that rescales the frequencies as `scaling` says: chosen once, at construction."""
    if scaling is None or scaling.rope_type == "default":
        return unscaled
    return functools.partial(llama3_scaled, scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self._scale = frequency_scaling(scaling)

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [s] -> [s, 1, 1, d], or [b, s] -> [s, b, 1, d]."""
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        inv_freq = self._scale(default_frequencies(self.head_dim, self.theta, position_ids.device, compute))
        freqs = position_ids.to(compute).unsqueeze(-1) * inv_freq  # [s, d/2] or [b, s, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        emb = emb.unsqueeze(1) if emb.dim() == 2 else emb.transpose(0, 1)
        emb = emb.unsqueeze(2)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor | None,
                offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [s, b, nh, d] and k [s, b, nkv, d] by their positions (default offset .. offset + s - 1)."""
        if position_ids is None:
            position_ids = torch.arange(offset, offset + q.shape[0], device=q.device)
        cos, sin = self.cos_sin(position_ids, q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class NoPositionEmbedding(nn.Module):
    """Attention without positions of its own (the model adds learned positions to its input)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids, offset: int = 0):
        return q, k


def build_position_embedding(config) -> nn.Module:
    """Rotary when `config.rotary`, else nothing: chosen once, so forward has no branch on it."""
    if not config.rotary:
        return NoPositionEmbedding()
    return RotaryEmbedding(config.head_dim, config.rope_theta, getattr(config, "rope_scaling", None))
