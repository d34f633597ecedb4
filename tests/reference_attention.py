"""A plain single-device attention, written independently of the library, for comparisons.

Works on the canonical weights (q_proj, k_proj, v_proj, o_proj) with explicit loops over
heads where it keeps the reading obvious. Shapes: x [s, b, h] -> [s, b, h].
"""

from __future__ import annotations

import math

import torch


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary on x [b, s, d] with positions [b, s]: element j pairs with j + d/2."""
    d = x.shape[-1]
    half = d // 2
    freq = torch.tensor([theta ** (-2.0 * i / d) for i in range(half)], dtype=torch.float64)
    angle = positions.to(torch.float64)[..., None] * freq  # [b, s, d/2]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_attention(x, weights, num_heads, num_kv_heads, head_dim, causal=True, mask=None,
                        rotary=False, positions=None, theta=10000.0):
    """softmax(q k^T / sqrt(d) + mask) v per head, then o_proj; fully masked rows give zeros."""
    s, b, _ = x.shape

    def proj(name, inp):
        y = inp @ weights[f"{name}.weight"].T
        return y + weights[f"{name}.bias"] if f"{name}.bias" in weights else y

    xb = x.transpose(0, 1)  # [b, s, h]
    q, k, v = proj("q_proj", xb), proj("k_proj", xb), proj("v_proj", xb)
    allowed = torch.ones(b, s, s, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(s, s, dtype=torch.bool).tril()
    if mask is not None:
        allowed &= mask.expand(b, 1, s, s)[:, 0]
    if positions is None:
        positions = torch.arange(s)
    positions = positions.expand(b, s)
    group = num_heads // num_kv_heads
    heads = []
    for i in range(num_heads):
        j = i // group  # the k/v head of query head i
        qi = q[..., i * head_dim:(i + 1) * head_dim]
        kj = k[..., j * head_dim:(j + 1) * head_dim]
        vj = v[..., j * head_dim:(j + 1) * head_dim]
        if rotary:
            qi, kj = rope(qi, positions, theta), rope(kj, positions, theta)
        scores = (qi @ kj.transpose(1, 2)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all -inf rows -> NaN -> 0
        heads.append(probs @ vj)
    context = torch.cat(heads, dim=-1)
    return proj("o_proj", context).transpose(0, 1)


def expected_fused_rows(q, k, v, rank, p, num_heads, num_kv_heads, head_dim):
    """Rows of the fused query_key_value held by `rank`: [its query heads | the k heads they use | the
    v heads they use]; ranks own consecutive query heads; k/v heads replicate when p > nkv.
    (Checkpoint format 1 interleaved them per query group instead: [q heads | k | v] per k/v head.)"""
    d, group = head_dim, num_heads // num_kv_heads
    first, last = rank * num_heads // p, (rank + 1) * num_heads // p - 1
    queries = list(range(first, last + 1))
    kv = sorted({i // group for i in queries})
    rows = [("q", i) for i in queries] + [("k", j) for j in kv] + [("v", j) for j in kv]
    source = {"q": q, "k": k, "v": v}
    return torch.cat([source[kind][h * d:(h + 1) * d] for kind, h in rows])
