"""Key/value cache for incremental decoding with ParallelSelfAttention.

Each rank caches only its own k/v heads: [b, nkv/p (at least 1), max_len, d] per layer.
`KVCache.layers[i]` is what layer i's attention receives; after a forward over n new tokens
the model calls `advance(n)` once.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads_per_rank: int, head_dim: int,
                 max_len: int, device=None, dtype: torch.dtype = torch.float32) -> None:
        self.max_len = max_len
        self.length = 0  # tokens already cached: the position of the next token
        shape = (batch_size, num_kv_heads_per_rank, max_len, head_dim)
        self.layers = [LayerKVCache(self, torch.zeros(shape, device=device, dtype=dtype),
                                    torch.zeros(shape, device=device, dtype=dtype)) for _ in range(num_layers)]

    def advance(self, n: int) -> None:
        self.length += n


class LayerKVCache:
    def __init__(self, parent: KVCache, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.parent, self.keys, self.values = parent, keys, values

    @property
    def offset(self) -> int:
        return self.parent.length

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [b, nkvl, n, d] after the cached tokens; return all keys/values so far."""
        start, n = self.offset, k.shape[2]
        if start + n > self.parent.max_len:
            raise ValueError(f"KVCache overflow: {start} cached + {n} new tokens > max_len={self.parent.max_len}.")
        self.keys[:, :, start:start + n] = k
        self.values[:, :, start:start + n] = v
        return self.keys[:, :, :start + n], self.values[:, :, :start + n]

    def causal_mask(self, n: int, device) -> torch.Tensor | None:
        """[1, 1, n, offset + n]: new query i (at offset + i) sees keys 0..offset + i; None for n = 1."""
        if n == 1:
            return None
        queries = torch.arange(self.offset, self.offset + n, device=device).unsqueeze(-1)
        return (torch.arange(self.offset + n, device=device) <= queries).view(1, 1, n, self.offset + n)
