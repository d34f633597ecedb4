"""Rotary position embedding, rotate-half form (GPT-NeoX; Llama in Hugging Face format).

Over the whole head dim d: frequencies theta^(-2i/d) for i < d/2, duplicated, so that element
j and j + d/2 rotate together. Computed in float32 (float64 for float64 inputs), like the
Hugging Face reference, then cast to the input dtype.
"""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [s] -> [s, 1, 1, d], or [b, s] -> [s, b, 1, d]."""
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        exponent = torch.arange(0, self.head_dim, 2, device=position_ids.device, dtype=torch.int64)
        inv_freq = 1.0 / (self.theta ** (exponent.to(compute) / self.head_dim))
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
    return RotaryEmbedding(config.head_dim, config.rope_theta) if config.rotary else NoPositionEmbedding()
