"""Attention dropout inside the ring (dropout_rng='layout_invariant'): the masks of cp = 1, block by block.

At cp = 1, LayoutInvariantCoreAttention drops the probabilities [b, nhl, s, s] with a mask hashed from the global
(sample, head, query, key) of each element. In the ring, the pair (q chunk c, k chunk c') of m = s / (2 cp) tokens
each is the block rows c m .., columns c' m .. of that matrix, so its mask is the same hash over

    [(first_sample, b, nh s s), (head_offset, nhl, s s), (c m, m, s), (c' m, m, 1)]

Dropout scales each probability by keep / (1 - p), elementwise and linearly, so it commutes with the ring's
log-sum-exp merge: the log-sum-exp comes from the undropped scores, each block's output uses its dropped,
rescaled probabilities, and the merged output is cp = 1's. The backward hashes the same mask again (nothing s x s
is kept): dV = P_d^T dO, dP = drop(dO V^T), dS = P o (dP - rowsum(dO o O)), with O the dropped output.

The tensor-parallel generator stream (dropout_rng='per_rank') cannot give cp = 1's masks (its draws follow the
layout), and the cp ranks of one tensor-parallel rank share its state: context parallelism refuses it with
attention dropout, for both kinds (`check_dropout_rng`).
"""

from __future__ import annotations

import torch

from ...tensor_parallel.dropout_hash import as_key
from ...tensor_parallel.layers import unchanged
from ...tensor_parallel.rng import current_dropout_coordinates
from ..dropout import DropoutSite, hashed_dropout


def check_dropout_rng(config, kind: str, cp: int) -> None:
    """ValueError for attention dropout from the tensor-parallel generator under context parallelism."""
    if config.attention_dropout > 0 and config.dropout_rng != "layout_invariant":
        raise ValueError(f"context parallelism (context_parallel_size={cp}, context_parallel_kind={kind!r}) with "
                         f"attention_dropout={config.attention_dropout} needs dropout_rng='layout_invariant' (got "
                         f"{config.dropout_rng!r}): the tensor-parallel generator's masks depend on the layout, and "
                         "the cp ranks of one tensor-parallel rank would draw the same ones. Set "
                         "dropout_rng='layout_invariant' (the masks of cp = 1), or attention_dropout=0.")


class NoBlockDropout:
    """No attention dropout (none configured, or not training): every pair's probabilities as they are."""

    def for_pair(self, q_chunk: int, k_chunk: int, like: torch.Tensor):
        return unchanged


NO_DROPOUT = NoBlockDropout()


class HashedBlockDropout:
    """The hashed masks of one ring call: (seed, step, first sample) read when the call starts, so its backward
    (and a recomputed forward, whose coordinates `checkpoint_with_tp_rng` replays) hashes the same ones."""

    def __init__(self, p: float, num_heads: int, head_offset: int, layer: int, m: int, cp: int) -> None:
        self.p, self.num_heads, self.head_offset, self.layer, self.m = p, num_heads, head_offset, layer, m
        self.s = 2 * cp * m
        self.coordinates = current_dropout_coordinates()

    def for_pair(self, q_chunk: int, k_chunk: int, like: torch.Tensor):
        """The dropout of pair (q_chunk, k_chunk), for probabilities shaped like `like` [b, nhl, m, m]."""
        b, nhl, m, s = like.shape[0], like.shape[1], self.m, self.s
        axes = [(self.coordinates.first_sample_tensor, b, self.num_heads * s * s), (self.head_offset, nhl, s * s),
                (q_chunk * m, m, s), (k_chunk * m, m, 1)]
        keep = self.coordinates.keep_mask(self.p, self.layer, DropoutSite.ATTENTION_PROBS, axes, like.device)
        return lambda t: hashed_dropout(t, keep, self.p)


class RingDropoutSpec:
    """What the ring's dropout needs from the block: p, the heads (all nh, this rank's first) and the layer."""

    def __init__(self, p: float, num_heads: int, head_offset: int, layer: int) -> None:
        self.p, self.num_heads, self.head_offset, self.layer = p, num_heads, head_offset, as_key(layer)

    def for_call(self, m: int, cp: int, training: bool):
        if not training:
            return NO_DROPOUT
        return HashedBlockDropout(self.p, self.num_heads, self.head_offset, self.layer, m, cp)
