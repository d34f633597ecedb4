"""A plain single-device attention from canonical weights, written apart from the library: the one reference that
the self-check (`equivalence`) and the tests compare ParallelSelfAttention against.

x [s, b, h] -> [s, b, h]: per query head i (k/v head i // (nh/nkv)), softmax(q k^T / sqrt(d) + mask) v,
rotate-half rotary on q and k at `positions` (default 0..s-1), then o_proj. Fully masked rows give zeros.
Explicit loops over heads keep the reading obvious; it runs on the CPU in the dtype of x (float64 in the check).
"""

from __future__ import annotations

import math

import torch


def _project(x: torch.Tensor, weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    y = x @ weights[f"{name}.weight"].T
    return y + weights[f"{name}.bias"] if f"{name}.bias" in weights else y


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary on x [b, s, d] with positions [b, s]: element j turns with j + d/2 at angle
    pos * theta^(-2j/d) (angles in float64)."""
    d = x.shape[-1]
    half = d // 2
    freq = torch.tensor([theta ** (-2.0 * j / d) for j in range(half)], dtype=torch.float64)
    angle = positions.to(torch.float64)[..., None] * freq  # [b, s, d/2]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_attention(x: torch.Tensor, weights: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int,
                        head_dim: int, causal: bool = True, mask: torch.Tensor | None = None, rotary: bool = False,
                        positions: torch.Tensor | None = None, theta: float = 10000.0) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v per head, then o_proj; `mask` bool, broadcastable to [b, 1, s, s],
    True where the query may attend the key; `positions` [b, s] or [s]."""
    s, b, _ = x.shape
    xb = x.transpose(0, 1)  # [b, s, h]
    q, k, v = (_project(xb, weights, name) for name in ("q_proj", "k_proj", "v_proj"))
    allowed = torch.ones(b, s, s, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(s, s, dtype=torch.bool).tril()
    if mask is not None:
        allowed &= mask.cpu().expand(b, 1, s, s)[:, 0]
    positions = (torch.arange(s) if positions is None else positions).expand(b, s)
    group, d = num_heads // num_kv_heads, head_dim
    heads = []
    for i in range(num_heads):
        j = i // group  # the k/v head of query head i
        qi, kj, vj = q[..., i * d:(i + 1) * d], k[..., j * d:(j + 1) * d], v[..., j * d:(j + 1) * d]
        if rotary:
            qi, kj = rope(qi, positions, theta), rope(kj, positions, theta)
        scores = (qi @ kj.transpose(1, 2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1).nan_to_num(0.0) @ vj)  # all -inf rows -> NaN -> 0
    return _project(torch.cat(heads, dim=-1), weights, "o_proj").transpose(0, 1)
