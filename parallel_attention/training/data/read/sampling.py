"""Which window of which source each sample of a run reads: pure functions of (seed, sample index).

Two rules, both computed for any sample index directly, with no state carried from step to step, so the batch of a
step is the same at every layout, after any resume, and at another data-parallel size:

- **Epochs without replacement** (`EpochWindows`). A source's training stream of T tokens is cut into
  n = (T - 1) // s windows of s + 1 tokens: window w covers tokens [w s, w s + s], so consecutive windows share
  only the label token and no token is an input twice. Sample k of the source is window perm_e(k mod n) of
  epoch e = k // n, where perm_e is a seeded permutation of [0, n): every window is read once before any repeats.
  The permutation is a Feistel network on the smallest even-bit domain >= n, cycle-walked into [0, n): a bijection
  evaluated per index in O(1) memory, and its output depends only on this code (numpy's and torch's generators
  do not promise the same stream across releases, which would break a resume after an upgrade).
- **Blending** (`blend`). Source j's k-th sample is due at "time" (k + 1/2) / w_j; the samples of a run, in order,
  are the due events sorted by time (ties by source index). After n samples source j has drawn
  c_j = round(w_j T) for the time T of the n-th event, which keeps |c_j - w_j n| <= 1/2 for two sources and
  < 1 for three (in general <= 1/2 + w_j (m - 2) / 2 for m sources). Megatron-LM's greedy rule gives the same
  bound but is sequential; this order is evaluated for any sample range in O(count + m).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["EpochWindows", "blend", "draws_before", "feistel_permutation", "splitmix64"]

_MASK64 = (1 << 64) - 1
_ROUNDS = 6


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Steele, Lea and Flood's 64-bit finaliser, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _round_keys(key: tuple[int, ...]) -> list[np.uint64]:
    state = 0
    for part in key:
        state = int(splitmix64(np.array([(state ^ (part & _MASK64)) & _MASK64], dtype=np.uint64))[0])
    return [np.uint64(int(splitmix64(np.array([state + r], dtype=np.uint64))[0])) for r in range(_ROUNDS)]


def feistel_permutation(index: np.ndarray, n: int, key: tuple[int, ...]) -> np.ndarray:
    """perm(index) for a seeded permutation `perm` of [0, n) named by `key` (a tuple of integers)."""
    index = np.asarray(index, dtype=np.uint64)
    if n <= 1:
        return np.zeros_like(index)
    half = max(1, math.ceil(math.log2(n) / 2))  # the domain 4**half >= n, so cycle-walking takes < 4 rounds
    mask, keys = np.uint64((1 << half) - 1), _round_keys(key)
    out = index.copy()
    todo = np.ones(out.shape, dtype=bool)
    while todo.any():
        x = out[todo]
        left, right = x >> np.uint64(half), x & mask
        for round_key in keys:
            left, right = right, left ^ (splitmix64(right ^ round_key) & mask)
        out[todo] = (left << np.uint64(half)) | right
        todo = out >= np.uint64(n)
    return out


class EpochWindows:
    """The windows of one source's training stream, read in a seeded order per epoch, without replacement."""

    def __init__(self, num_tokens: int, seq_len: int, seed: int, source_index: int) -> None:
        self.seq_len, self.seed, self.source_index = seq_len, seed, source_index
        self.num_windows = (num_tokens - 1) // seq_len

    def offsets(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token offset of each sample's window in the stream, its epoch) for the source's sample indices."""
        samples = np.asarray(samples, dtype=np.int64)
        epochs, positions = np.divmod(samples, self.num_windows)
        windows = np.empty_like(samples)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            windows[chosen] = feistel_permutation(positions[chosen], self.num_windows,
                                                  (self.seed, self.source_index, int(epoch))).astype(np.int64)
        return windows * self.seq_len, epochs


def _first_due(weight: float, time: float) -> int:
    """The smallest k >= 0 whose due time (k + 1/2) / weight is >= time (exact for the float comparison used)."""
    k = max(0, math.ceil(time * weight - 0.5))
    while k > 0 and (k - 0.5) / weight >= time:
        k -= 1
    while (k + 0.5) / weight < time:
        k += 1
    return k


def _events(weights: np.ndarray, start: int, count: int):
    """(draws of each source before the window, sources and their sample indices in order, global index of the
    window's first event), for a window of due events that covers samples [start, start + count)."""
    margin = len(weights) + 2
    low, high = max(0.0, start - margin), start + count + margin
    while True:
        before = np.array([_first_due(w, low) for w in weights], dtype=np.int64)
        upto = np.array([_first_due(w, high) for w in weights], dtype=np.int64)
        if before.sum() <= start and upto.sum() >= start + count:
            break
        low, high, margin = max(0.0, low - margin), high + margin, 2 * margin
    sources = np.concatenate([np.full(u - b, j, dtype=np.int64) for j, (b, u) in enumerate(zip(before, upto))])
    draws = np.concatenate([np.arange(b, u, dtype=np.int64) for b, u in zip(before, upto)])
    due = (draws + 0.5) / weights[sources]
    order = np.lexsort((sources, due))
    return before, sources[order], draws[order], int(before.sum())


def _normalised(weights) -> np.ndarray:
    weights = np.asarray(weights, dtype=np.float64)
    return weights / weights.sum()


def blend(weights, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, that source's sample index) of samples start .. start + count - 1 of the blend."""
    _, sources, draws, first = _events(_normalised(weights), start, count)
    return sources[start - first:start - first + count], draws[start - first:start - first + count]


def draws_before(weights, n: int) -> np.ndarray:
    """How many of the first `n` samples of the blend each source gave."""
    before, sources, _, first = _events(_normalised(weights), n, 0)
    return before + np.bincount(sources[:n - first], minlength=len(before))
