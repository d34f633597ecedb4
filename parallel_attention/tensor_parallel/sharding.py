"""Pure functions between canonical (full, p-independent) weights and tensor-parallel shards.

The one place that knows how each kind of weight is split, used by the modules (to load and
gather their weights), by checkpoint resharding and by the Hugging Face conversion, so that a
layout is written down once. Shapes: p tensor-parallel size, nh heads, nkv k/v heads, d head dim.

    kind         canonical            shard of rank r
    column       [out, ...]           rows r*out/p ..            (ColumnParallelLinear weight/bias)
    row          [out, in]            columns r*in/p ..          (RowParallelLinear weight)
    vocab        [V, h]               rows of the table padded to V_padded (zeros past V)
    qkv          q [nh d, ...], k, v [nkv d, ...]
                                      per local group: [its q heads | k | v]; k/v replicated if p > nkv
    gated        gate, up [f, ...]    [gate rows of r | up rows of r]
    replicated   any                  the whole tensor on every rank
"""

from __future__ import annotations

import torch


def column_shard(t: torch.Tensor, p: int, rank: int) -> torch.Tensor:
    return t.chunk(p, dim=0)[rank]


def row_shard(t: torch.Tensor, p: int, rank: int) -> torch.Tensor:
    return t.chunk(p, dim=1)[rank]


def vocab_shard(t: torch.Tensor, padded_size: int, p: int, rank: int) -> torch.Tensor:
    full = t.new_zeros((padded_size, *t.shape[1:]))
    full[:t.shape[0]] = t
    return column_shard(full, p, rank)


def vocab_unshard(shards: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    return torch.cat(shards, dim=0)[:vocab_size]


def kv_heads_of_rank(num_kv_heads: int, p: int, rank: int) -> list[int]:
    """Global k/v heads rank `rank` holds, in local order (one replica when p > nkv)."""
    if p > num_kv_heads:
        return [rank // (p // num_kv_heads)]
    per_rank = num_kv_heads // p
    return list(range(rank * per_rank, (rank + 1) * per_rank))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int, p: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s rows of the fused projection from full q/k/v weights or biases."""
    rest, d = q.shape[1:], head_dim
    kv_heads = kv_heads_of_rank(num_kv_heads, p, rank)
    heads_per_rank = num_heads // p
    q_heads = q.reshape(num_heads, d, *rest)[rank * heads_per_rank:(rank + 1) * heads_per_rank]
    q_heads = q_heads.reshape(len(kv_heads), heads_per_rank // len(kv_heads), d, *rest)
    index = torch.tensor(kv_heads, device=q.device)
    k_heads = k.reshape(num_kv_heads, d, *rest).index_select(0, index).unsqueeze(1)
    v_heads = v.reshape(num_kv_heads, d, *rest).index_select(0, index).unsqueeze(1)
    return torch.cat([q_heads, k_heads, v_heads], dim=1).reshape(-1, *rest)


def unfuse_qkv(shards: list[torch.Tensor], num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full q, k, v from every rank's fused rows (p = len(shards))."""
    p, rest, d = len(shards), shards[0].shape[1:], head_dim
    kv_per_rank = len(kv_heads_of_rank(num_kv_heads, p, 0))
    queries_per_group = num_heads // p // kv_per_rank
    q_parts = []
    k = shards[0].new_empty((num_kv_heads, d, *rest))
    v = shards[0].new_empty((num_kv_heads, d, *rest))
    for rank, shard in enumerate(shards):
        groups = shard.reshape(kv_per_rank, queries_per_group + 2, d, *rest)
        q_parts.append(groups[:, :queries_per_group].reshape(-1, *rest))
        for local, head in enumerate(kv_heads_of_rank(num_kv_heads, p, rank)):
            k[head], v[head] = groups[local, queries_per_group], groups[local, queries_per_group + 1]
    return torch.cat(q_parts), k.reshape(-1, *rest), v.reshape(-1, *rest)


def fuse_gated(gate: torch.Tensor, up: torch.Tensor, p: int, rank: int) -> torch.Tensor:
    return torch.cat([column_shard(gate, p, rank), column_shard(up, p, rank)])


def unfuse_gated(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])


def check_canonical(state_dict: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], what: str,
                    hint: str = "") -> None:
    """Refuse a canonical state dict with missing, unexpected or mis-shaped tensors, naming them."""
    missing, unexpected = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{what}: missing {missing}, unexpected {unexpected}{hint}.")
    for name, shape in expected.items():
        if tuple(state_dict[name].shape) != tuple(shape):
            raise ValueError(f"{what}: {name} has shape {tuple(state_dict[name].shape)}, expected {tuple(shape)}"
                             f"{hint}.")
