"""A plain single-device float64 attention from canonical weights, written apart from the library.

x [s, b, h] -> [s, b, h]: per query head i (k/v head i // (nh/nkv)), softmax(q k^T / sqrt(d) + mask) v,
rotate-half rotary on q and k at positions 0..s-1, then o_proj. Fully masked rows give zeros.
"""

from __future__ import annotations

import math

import torch


def _project(x: torch.Tensor, weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    y = x @ weights[f"{name}.weight"].T
    return y + weights[f"{name}.bias"] if f"{name}.bias" in weights else y


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary on x [b, s, d]: element j turns with j + d/2 at angle pos * theta^(-2j/d)."""
    s, d = x.shape[1], x.shape[-1]
    half = d // 2
    freq = torch.tensor([theta ** (-2.0 * j / d) for j in range(half)], dtype=torch.float64)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * freq  # [s, d/2]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], dim=-1)


def reference_attention(x: torch.Tensor, weights: dict[str, torch.Tensor], config,
                        key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`config` gives num_heads, num_kv_heads, head_dim, causal, rotary, rope_theta; key_mask [b, 1, 1, s]."""
    s, b, _ = x.shape
    d, group = config.head_dim, config.num_heads // config.num_kv_heads
    xb = x.transpose(0, 1)  # [b, s, h]
    q, k, v = (_project(xb, weights, name) for name in ("q_proj", "k_proj", "v_proj"))
    allowed = torch.ones(b, s, s, dtype=torch.bool)
    if config.causal:
        allowed &= torch.ones(s, s, dtype=torch.bool).tril()
    if key_mask is not None:
        allowed &= key_mask.cpu().expand(b, 1, s, s)[:, 0]
    heads = []
    for i in range(config.num_heads):
        j = i // group
        qi, kj, vj = q[..., i * d:(i + 1) * d], k[..., j * d:(j + 1) * d], v[..., j * d:(j + 1) * d]
        if config.rotary:
            qi, kj = _rotate(qi, config.rope_theta), _rotate(kj, config.rope_theta)
        scores = (qi @ kj.transpose(1, 2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1).nan_to_num(0.0) @ vj)
    return _project(torch.cat(heads, dim=-1), weights, "o_proj").transpose(0, 1)
