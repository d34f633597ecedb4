"""Ring attention: k/v blocks travel the context-parallel ring while each rank attends the block in hand.

Shapes (per rank): q [b, nhl, 2m, d], k, v [b, nkvl, 2m, d]: this rank's zigzag part, chunks r and 2 cp - 1 - r of
2 cp chunks of m = s / (2 cp) tokens. Step t (of cp) holds the k/v part of rank r - t; the next part is posted
(ring_exchange: one batched send and receive) before the block in hand is computed, so the transfer overlaps it.

    forward:  per (q chunk, k chunk) pair: skipped when the mask hides it entirely (causal: k chunk after the
              q chunk; documents: no DocumentLayout.block_pieces, decided on the host without a sync), else scores
              = q k^T / sqrt(d), masked, and the partial output merged with the running one by log-sum-exp (exact;
              the pair's kernel, `ring_blocks`: the device's fused flash operator where it applies, else
              explicit-lse torch math, the only one that reads a mask, built for it per pair; merged in float32
              for half inputs); with attention dropout (dropout_rng='layout_invariant', `ring_dropout`) each
              pair's probabilities are dropped with the mask of its global (sample, head, query, key): the output
              of cp = 1
    backward: recomputes each pair's probabilities from the final lse (and its dropout mask from the hash); dQ
              stays here, dK/dV of a block travel with it around the ring and come home with one last exchange

Collectives per layer: forward cp - 1 ring exchanges (k and v stacked); backward cp - 1 (k, v) + cp (dK, dV).
Under the causal zigzag every rank computes the same number of pairs: 2 cp + 1 (2 diagonal, 2 cp - 1 full).
"""

from __future__ import annotations

import math

import torch

from ...tensor_parallel.collectives import ring_exchange
from ...tensor_parallel.parallel_state import ProcessGroup, group_rank, group_size
from ..kernels.flash_ops import accumulation_dtype
from ..kernels.ring_blocks import MATH_BLOCKS, Pair, finite
from .ring_dropout import NO_DROPOUT
from .zigzag import chunk_ids


class BlockMasks:
    """Which (q chunk, k chunk) pairs run, and with what mask: causal by chunk number, or the documents'. Deciding
    which pairs run costs no tensor operation and no host sync (the documents' pieces come from their host-side
    spans, kept per batch); a mask is built only when a kernel asks for it (`mask`), never kept by the ring."""

    def __init__(self, m: int, causal: bool, documents=None, device=None) -> None:
        self.m, self.causal, self.documents, self.device = m, causal, documents, device

    def _index(self, chunk: int) -> torch.Tensor:
        return torch.arange(chunk * self.m, (chunk + 1) * self.m, device=self.device)

    def diagonal(self, q_chunk: int, k_chunk: int) -> bool:
        """Whether the pair is the causal diagonal block (no documents): the fused kernels' is_causal."""
        return self.causal and self.documents is None and q_chunk == k_chunk

    def runs(self, q_chunk: int, k_chunk: int) -> tuple[bool, tuple | None]:
        """(runs, pieces): whether any query of the pair may attend a key of it, and with documents the pair's
        per-document sub-pairs (DocumentLayout.block_pieces: none exactly when the pair is hidden), else None."""
        if self.documents is not None:
            pieces = self.documents.block_pieces(q_chunk * self.m, k_chunk * self.m, self.m, self.causal)
            return bool(pieces), pieces
        return not self.causal or k_chunk <= q_chunk, None

    def mask(self, q_chunk: int, k_chunk: int) -> torch.Tensor | None:
        """The pair's bool mask, broadcastable to [b, nh, m, m], built now; None = every key visible."""
        if self.documents is not None:
            return self.documents.mask(self._index(q_chunk), self._index(k_chunk), self.causal)
        if self.diagonal(q_chunk, k_chunk):
            return torch.ones(self.m, self.m, dtype=torch.bool, device=self.device).tril_()
        return None

    def pair(self, q_chunk: int, k_chunk: int) -> tuple[bool, torch.Tensor | None, tuple | None]:
        """(runs, mask, pieces) of the pair (`runs`, its mask built by `mask` when it runs)."""
        runs, pieces = self.runs(q_chunk, k_chunk)
        return runs, self.mask(q_chunk, k_chunk) if runs else None, pieces


def _merge(out, lse, block_out, block_lse):
    """The running (out, lse) with a pair's, by log-sum-exp, in the running pair's (accumulation) dtype."""
    new = torch.logaddexp(lse, block_lse)
    safe = finite(new)
    weight_old, weight_new = torch.exp(lse - safe).unsqueeze(-1), torch.exp(block_lse - safe).unsqueeze(-1)
    return out * weight_old + block_out * weight_new, new


class RingPlan:
    """What a ring attention call needs besides q, k, v: the group, the chunks each rank holds, the masks and
    the attention dropout (`ring_dropout`: NO_DROPOUT or the hashed masks of this call) and the per-pair kernel
    (`ring_blocks`). `queries_per_group` (nh / nkv) is what the kernels also read from the shapes."""

    def __init__(self, group: ProcessGroup, masks: BlockMasks, queries_per_group: int, dropout=NO_DROPOUT,
                 blocks=MATH_BLOCKS) -> None:
        self.group, self.masks, self.queries_per_group, self.dropout = group, masks, queries_per_group, dropout
        self.blocks = blocks
        self.size, self.rank = group_size(group), group_rank(group)

    def pairs(self, step: int, q: torch.Tensor | None = None):
        """The Pair (ring_blocks) of every pair that runs at ring step `step` (the k/v of rank rank - step), each
        with its mask where the kernel reads one for `q` (`reads_masks`; None: none is built)."""
        source = (self.rank - step) % self.size
        mine, theirs = chunk_ids(self.size, self.rank), chunk_ids(self.size, source)
        with_masks = q is not None and self.blocks.reads_masks(q)
        for i, q_chunk in enumerate(mine):
            for j, k_chunk in enumerate(theirs):
                runs, pieces = self.masks.runs(q_chunk, k_chunk)
                if runs:
                    mask = self.masks.mask(q_chunk, k_chunk) if with_masks else None
                    yield Pair(i, j, mask, (q_chunk, k_chunk), self.masks.diagonal(q_chunk, k_chunk), pieces)

    def drop(self, chunks: tuple[int, int], like: torch.Tensor):
        """The dropout of the pair of `chunks` (the identity without attention dropout)."""
        return self.dropout.for_pair(*chunks, like)

    def computed_pairs(self) -> int:
        """How many block pairs this rank computes in one forward (the balance the zigzag buys)."""
        return sum(1 for step in range(self.size) for _ in self.pairs(step))


def _halves(t: torch.Tensor, m: int):
    return t.split(m, dim=-2)


def _sequence_major(halves) -> torch.Tensor:
    """The two halves [b, nh, m, d] as one [b, nh, 2m, d] laid out [2m, b, nh, d] in memory: the block's
    permute + reshape to [2m, b, nh d] is then a view, and the dense layer's saved input shares this storage
    with the output the ring keeps for backward (one copy of the attention output per layer, not two)."""
    return torch.cat([half.permute(2, 0, 1, 3) for half in halves]).permute(1, 2, 0, 3)


class RingAttention(torch.autograd.Function):
    """k/v keep their own heads (the pair kernels take grouped heads); the running output, the lse and the
    gradients that travel the ring are in the accumulation dtype (float32 for half inputs)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan):
        m, scale, acc = plan.masks.m, 1.0 / math.sqrt(q.shape[-1]), accumulation_dtype(q.dtype)
        b, nh, _, d = q.shape
        out = [q.new_zeros(b, nh, m, d, dtype=acc) for _ in range(2)]
        lse = [q.new_full((b, nh, m), float("-inf"), dtype=acc) for _ in range(2)]
        kv = torch.stack([k, v])
        for step in range(plan.size):
            pending = ring_exchange([kv], plan.group) if step < plan.size - 1 else None
            ks, vs = (_halves(t, m) for t in kv.unbind())
            for pair in plan.pairs(step, q):
                i, j = pair.i, pair.j
                block = plan.blocks.forward(_halves(q, m)[i], ks[j], vs[j], pair, scale, plan.drop(pair.chunks, q))
                out[i], lse[i] = _merge(out[i], lse[i], *block)
            kv = pending.wait()[0] if pending is not None else kv
        out, lse = _sequence_major([o.to(q.dtype) for o in out]), torch.stack(lse)  # lse [2, b, nh, m]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        m, scale, acc = plan.masks.m, 1.0 / math.sqrt(q.shape[-1]), accumulation_dtype(q.dtype)
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1)  # [b, nh, 2m]: rowsum(dO o O)
        qs, dos, lses, deltas = _halves(q, m), _halves(grad_out, m), lse.unbind(), delta.split(m, -1)
        outs = _halves(out, m)
        dq = [torch.zeros_like(h, dtype=acc) for h in qs]
        # One batched exchange a step, posted before the step's pieces so that the transfer overlaps them: the next
        # k/v block, and the dK, dV accumulated for the block held at the previous step, which the next rank holds
        # now (they travel with their block, one step behind it); the last accumulator goes home after the loop.
        kv, dkv = torch.stack([k, v]), None
        for step in range(plan.size):
            kv_ahead = step < plan.size - 1
            pending = ring_exchange(([kv] if kv_ahead else []) + ([dkv] if dkv is not None else []), plan.group)
            ks, vs = (_halves(t, m) for t in kv.unbind())
            dk, dv = [[torch.zeros_like(h, dtype=acc) for h in ks] for _ in range(2)]
            for pair in plan.pairs(step, q):
                i, j, drop = pair.i, pair.j, plan.drop(pair.chunks, q)  # the forward's dropout mask, hashed again
                grads = plan.blocks.backward(qs[i], ks[j], vs[j], pair, scale, drop, dos[i], outs[i], lses[i],
                                             deltas[i])
                dq[i], dk[j], dv[j] = dq[i] + grads[0], dk[j] + grads[1], dv[j] + grads[2]
            mine = torch.stack([torch.cat(dk, 2), torch.cat(dv, 2)])
            received = pending.wait() if pending is not None else []
            dkv = mine if dkv is None else received[-1] + mine
            kv = received[0] if kv_ahead else kv
        pending = ring_exchange([dkv], plan.group)
        dkv = pending.wait()[0] if pending is not None else dkv
        dk, dv = dkv.unbind()
        return torch.cat(dq, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
