"""Pure functions between canonical (full, p-independent) weights and tensor-parallel shards.

The one place that knows how each kind of weight is split, used by the modules (to load and
gather their weights), by checkpoint resharding and by the Hugging Face conversion, so that a
layout is written down once. Shapes: p tensor-parallel size, nh heads, nkv k/v heads, d head dim.

    kind         canonical            shard of rank r
    column       [out, ...]           rows r*out/p ..            (ColumnParallelLinear weight/bias)
    row          [out, in]            columns r*in/p ..          (RowParallelLinear weight)
    vocab        [V, h]               rows of the table padded to V_padded (`padded_vocab_size`, zeros past V)
    qkv          q [nh d, ...], k, v [nkv d, ...]
                                      [its q heads | its k heads | its v heads]; k/v replicated if p > nkv
                                      (checkpoint format 1 held per local group [q heads | k | v]:
                                      `grouped_to_blocked_qkv` converts)
    gated        gate, up [f, ...]    [gate rows of r | up rows of r]
    replicated   any                  the whole tensor on every rank
    sequence     activations [s, ...]  chunk r of s/p along s (sequence parallelism: `check_sequence_split`)
"""

from __future__ import annotations

import torch


def check_sequence_split(length: int, p: int) -> None:
    """Refuse a sequence that sequence parallelism cannot cut into p equal chunks, before any collective."""
    if length % p != 0:
        raise ValueError(f"sequence length {length} is not divisible by tensor-parallel size {p}; "
                         "sequence parallelism needs s % p == 0: pad the sequence.")


def column_shard(t: torch.Tensor, p: int, rank: int) -> torch.Tensor:
    return t.chunk(p, dim=0)[rank]


def row_shard(t: torch.Tensor, p: int, rank: int) -> torch.Tensor:
    return t.chunk(p, dim=1)[rank]


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The project's one vocabulary padding: round up to a multiple of 64 p, for GPTModel and for
    `hf.parallelize` alike. Why 64 p: the table splits evenly over p ranks and each rank's [V_padded/p, h] GEMM
    keeps a multiple of 64 rows (Megatron-LM pads to 128 p for the same reason); and GPTModel's checkpoint
    shards (`model_tpNN`) hold V_padded/p rows, so this rule is part of the checkpoint format. The padding rows
    are zeros that no token id reaches; canonical weights and saved transformers models drop them."""
    multiple = 64 * tp_size
    return multiple * -(-vocab_size // multiple)


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


def head_rows(t: torch.Tensor, num_heads: int, p: int, rank: int) -> torch.Tensor:
    """The rows of `t` (num_heads equal blocks along dim 0) of the heads rank `rank` holds: its 1/p of them, or when
    p > num_heads the one head it keeps a replica of (the k/v heads, `kv_heads_of_rank`)."""
    heads, per_head = kv_heads_of_rank(num_heads, p, rank), t.shape[0] // num_heads
    return t[heads[0] * per_head:(heads[-1] + 1) * per_head]


def head_rows_unshard(shards: list[torch.Tensor], num_heads: int) -> torch.Tensor:
    """The whole tensor from every rank's `head_rows` (p = len(shards); one replica of each head)."""
    return torch.cat(shards[::max(len(shards) // num_heads, 1)])


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int, p: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s rows of the fused projection from full q/k/v weights or biases:
    [q heads of rank | its k heads | its v heads], so that q, k and v are plain views of the output."""
    rest, d = q.shape[1:], head_dim
    index = torch.tensor(kv_heads_of_rank(num_kv_heads, p, rank), device=q.device)
    q_rows = column_shard(q, p, rank)
    k_rows = k.reshape(num_kv_heads, d, *rest).index_select(0, index).reshape(-1, *rest)
    v_rows = v.reshape(num_kv_heads, d, *rest).index_select(0, index).reshape(-1, *rest)
    return torch.cat([q_rows, k_rows, v_rows])


def unfuse_qkv(shards: list[torch.Tensor], num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full q, k, v from every rank's fused rows (p = len(shards))."""
    p, rest, d = len(shards), shards[0].shape[1:], head_dim
    q_rows, kv_rows = num_heads // p * d, len(kv_heads_of_rank(num_kv_heads, p, 0)) * d
    q_parts = []
    k = shards[0].new_empty((num_kv_heads, d, *rest))
    v = shards[0].new_empty((num_kv_heads, d, *rest))
    for rank, shard in enumerate(shards):
        q_part, k_part, v_part = shard.split([q_rows, kv_rows, kv_rows])
        q_parts.append(q_part)
        for local, head in enumerate(kv_heads_of_rank(num_kv_heads, p, rank)):
            k[head], v[head] = k_part[local * d:(local + 1) * d], v_part[local * d:(local + 1) * d]
    return torch.cat(q_parts), k.reshape(-1, *rest), v.reshape(-1, *rest)


def grouped_to_blocked_qkv(shard: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                           p: int) -> torch.Tensor:
    """A fused shard in checkpoint format 1's per-group row order, [q heads | k | v] per local k/v
    head, reordered to today's [all q | all k | all v] (the same rows: a permutation)."""
    kv_per_rank = len(kv_heads_of_rank(num_kv_heads, p, 0))
    queries_per_group = num_heads // p // kv_per_rank
    groups = shard.reshape(kv_per_rank, queries_per_group + 2, head_dim, *shard.shape[1:])
    q, k, v = groups.split([queries_per_group, 1, 1], dim=1)
    return torch.cat([t.reshape(-1, *shard.shape[1:]) for t in (q, k, v)])


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
