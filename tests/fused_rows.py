"""The rows of the fused query_key_value weight each rank should hold, written apart from `sharding.fuse_qkv`."""

from __future__ import annotations

import torch


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
