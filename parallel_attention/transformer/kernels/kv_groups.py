"""Grouped-query attention's k/v heads, repeated to the query heads for a kernel that cannot read them grouped.

Query head i reads k/v head i // (nh / nkv): repeating each k/v head nh / nkv times in place (repeat_interleave on
the heads dim) gives every query head its own copy, and the gradient of the copies is each group's sum. Kernels
that take grouped heads as they are (SDPA's enable_gqa, the flash operators, varlen_attn) never call this: the
copies cost (nh / nkv - 1) x k and v's memory, saved for backward.
"""

from __future__ import annotations

import torch


def repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """t [b, nkv, s, d] with each k/v head repeated to `heads` heads (a multiple of nkv): [b, heads, s, d]; t itself
    when it already has them."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def sum_kv_groups(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of repeat_kv: t [b, heads, s, d] summed over each group onto its `kv_heads` k/v heads."""
    return t if t.shape[1] == kv_heads else t.unflatten(1, (kv_heads, -1)).sum(2)
