"""Batches from a blend of token sources, as a pure function of (seed, step), and the blend opened for them.

The global batch of step t is samples [t B, (t + 1) B) of the run (B = training.global_batch_size). Each sample's
source comes from the blend order and its window from that source's epoch order (the two rules below), or, with
`data.sampling: random_windows` (runs started before epochs existed), from previous_format.random_window_offsets.
Data-parallel rank r takes rows [r B/dp, (r + 1) B/dp): ranks of one tensor-parallel group see identical batches,
the union over dp ranks is the same global batch for any layout, and a resumed run, at any data-parallel size,
sees exactly the batches it would have seen. Both rules are evaluated for any sample index directly:

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
from dataclasses import dataclass

import numpy as np
import torch

from ....transformer.cross_entropy import IGNORE_INDEX
from ....transformer.documents import mask_cross_document_labels
from ...config.schema import PretrainConfig
from ..previous_format import random_window_offsets
from .token_source import TokenSource, TokenStream, index_cache_root, open_blend

__all__ = ["EpochWindows", "GlobalBatchSampler", "SampleRows", "SAMPLINGS", "blend", "check_fits", "describe_blend",
           "draws_before", "feistel_permutation", "open_run_blend", "read_micro_batches", "read_rows", "run_sampler",
           "splitmix64"]

SAMPLINGS = ("epochs", "random_windows")
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


@dataclass
class SampleRows:
    """Where the rows of a batch come from: per row its source index, the source's sample index (its draw), the
    epoch of that source it belongs to, and the offset of its window in the source's stream."""

    source: np.ndarray
    draw: np.ndarray
    epoch: np.ndarray
    offset: np.ndarray

    def __getitem__(self, rows: slice) -> SampleRows:
        return SampleRows(self.source[rows], self.draw[rows], self.epoch[rows], self.offset[rows])


def check_fits(stream: TokenStream, seq_len: int, split: str) -> None:
    if stream.num_tokens < seq_len + 1:
        raise ValueError(f"the {split} tokens of {stream.name} number {stream.num_tokens}, fewer than seq_len+1="
                         f"{seq_len + 1}: use a shorter data.seq_len, a larger corpus or another data.val_fraction.")


def _rows_per_rank(batch_size: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> int:
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size}).")
    if batch_size % (dp_size * micro_batch_size) != 0:
        raise ValueError(f"batch size {batch_size} is not a multiple of micro_batch_size={micro_batch_size} x "
                         f"data-parallel size {dp_size}.")
    return batch_size // dp_size


def read_rows(streams: list[TokenStream], rows: SampleRows, length: int,
              documents: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens [n, length], document index of each token or None): the windows of `rows`, each from its source."""
    tokens = np.empty((len(rows.source), length), dtype=np.int64)
    docs = np.empty_like(tokens) if documents else None
    for j in np.unique(rows.source):
        chosen = rows.source == j
        tokens[chosen] = streams[j].windows(rows.offset[chosen], length)
        if documents:
            docs[chosen] = streams[j].window_documents(rows.offset[chosen], length)
    return torch.from_numpy(tokens), None if docs is None else torch.from_numpy(docs)


def read_micro_batches(streams: list[TokenStream], rows: SampleRows, length: int, micro_batch_size: int,
                       document_masking: bool) -> list[tuple[torch.Tensor, ...]]:
    """(tokens [mb, s], labels [mb, s]) per micro-batch, labels shifted by one; with document masking
    (tokens, labels, document_ids [mb, s]) whose labels that predict the next document's first token are
    IGNORE_INDEX (packed documents: data.document_masking)."""
    tokens, documents = read_rows(streams, rows, length, document_masking)
    if documents is None:
        return [(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()) for chunk in tokens.split(micro_batch_size)]
    return [(chunk[:, :-1].contiguous(),
             mask_cross_document_labels(chunk[:, 1:].contiguous(), docs[:, 1:], docs[:, :-1], IGNORE_INDEX),
             docs[:, :-1].contiguous()) for chunk, docs in zip(tokens.split(micro_batch_size),
                                                               documents.split(micro_batch_size))]


class GlobalBatchSampler:
    """Global batches of `global_batch_size` windows of seq_len + 1 tokens from a weighted blend of sources."""

    def __init__(self, sources: list[TokenSource], weights: list[float], seq_len: int, global_batch_size: int,
                 seed: int, document_masking: bool = False, sampling: str = "epochs") -> None:
        if sampling not in SAMPLINGS:
            raise ValueError(f"data.sampling={sampling!r} is not one of {list(SAMPLINGS)}.")
        if sampling == "random_windows" and len(sources) != 1:
            raise ValueError(f"data.sampling=random_windows reads a single source, and data.blend names "
                             f"{len(sources)}: use data.sampling=epochs for a blend.")
        for source in sources:
            check_fits(source.train, seq_len, "training")
        self.sources, self.weights = sources, np.asarray(weights, dtype=np.float64)
        self.streams = [source.train for source in sources]
        self.seq_len, self.global_batch_size, self.seed = seq_len, global_batch_size, seed
        self.document_masking, self.sampling = document_masking, sampling
        self.windows = [EpochWindows(s.num_tokens, seq_len, seed, j) for j, s in enumerate(self.streams)]
        # a blend that changed mid-run (blend_history.py): this one's first step, each source's windows read before
        self.first_step, self.first_draws, self.earlier = 0, np.zeros(len(sources), dtype=np.int64), None

    def continue_at(self, first_step: int, keys: list[int], first_draws: list[int], earlier=None) -> None:
        """Make this the run's blend from `first_step` on: source j continues its own epochs, with the window order
        named by `keys[j]` (its index in the blend it first appeared in) after `first_draws[j]` windows read.
        `earlier(step)`, if given, is the sampler of an earlier step's blend (`phase_at`)."""
        self.first_step, self.first_draws, self.earlier = first_step, np.asarray(first_draws, np.int64), earlier
        self.windows = [EpochWindows(s.num_tokens, self.seq_len, self.seed, k) for s, k in zip(self.streams, keys)]

    def phase_at(self, step: int) -> GlobalBatchSampler:
        """The sampler whose blend the run read at `step`: this one, or an earlier blend's."""
        if step >= self.first_step:
            return self
        if self.earlier is None:
            raise ValueError(f"step {step} was read by an earlier blend of this run (this one starts at step "
                             f"{self.first_step}): open the run's data with its history (step_records.open_run_data).")
        return self.earlier(step)

    def rows(self, step: int) -> SampleRows:
        """Where every row of the global batch of `step` comes from; cheap, so every rank computes all of them."""
        if step < self.first_step:
            return self.phase_at(step).rows(step)
        first = (step - self.first_step) * self.global_batch_size
        if self.sampling == "random_windows":  # high: the last valid start + 1
            offsets = random_window_offsets(self.seed, step, self.global_batch_size,
                                            self.streams[0].num_tokens - self.seq_len)
            draws = np.arange(first, first + self.global_batch_size, dtype=np.int64)
            return SampleRows(np.zeros_like(draws), draws, draws // self.windows[0].num_windows, offsets)
        sources, draws = blend(self.weights, first, self.global_batch_size)
        draws = draws + self.first_draws[sources]  # each source's own count of windows read in this run
        offsets, epochs = np.empty_like(draws), np.empty_like(draws)
        for j in np.unique(sources):
            chosen = sources == j
            offsets[chosen], epochs[chosen] = self.windows[j].offsets(draws[chosen])
        return SampleRows(sources, draws, epochs, offsets)

    def global_batch(self, step: int) -> torch.Tensor:
        """LongTensor [global_batch_size, seq_len + 1]."""
        phase = self.phase_at(step)
        return read_rows(phase.streams, phase.rows(step), self.seq_len + 1, False)[0]

    def local_micro_batches(self, step: int, dp_rank: int, dp_size: int,
                            micro_batch_size: int) -> list[tuple[torch.Tensor, ...]]:
        """This data-parallel rank's rows of the global batch, as (tokens, labels[, document_ids]) micro-batches
        [mb, seq_len]. Only this rank's rows are read from disk."""
        per_rank = _rows_per_rank(self.global_batch_size, dp_rank, dp_size, micro_batch_size)
        phase = self.phase_at(step)
        mine = phase.rows(step)[slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)]
        return read_micro_batches(phase.streams, mine, self.seq_len + 1, micro_batch_size, self.document_masking)

    def epochs(self, steps_done: int) -> dict[str, float]:
        """Each source's epochs read after `steps_done` steps (1.25: a quarter into its second epoch)."""
        if self.sampling == "random_windows":
            drawn = np.array([steps_done * self.global_batch_size])
        else:
            drawn = draws_before(self.weights, max(0, steps_done - self.first_step) * self.global_batch_size) \
                + self.first_draws
        return {s.name: round(float(n) / w.num_windows, 4) for s, n, w in zip(self.sources, drawn, self.windows)}


def run_sampler(cfg: PretrainConfig, sources: list[TokenSource], weights: list[float]) -> GlobalBatchSampler:
    """The sampler a run of `cfg` trains with: the trainer and inspect_data.py both build it here."""
    return GlobalBatchSampler(sources, weights, cfg.data.seq_len, cfg.training.global_batch_size,
                              cfg.training.seed, cfg.data.document_masking, cfg.data.sampling)


def open_run_blend(cfg: PretrainConfig) -> tuple[list[TokenSource], list[float]]:
    """The blend's sources as a run of `cfg` opens them (token_source.open_blend), and their weights. Opened here,
    by the module that reads them, so that a reader enters token_source from one place (docs/architecture.md)."""
    return open_blend(cfg.data, index_cache_root(cfg), cfg.model.vocab_size)


def describe_blend(sampler, max_steps: int) -> str:
    """One line per source of a GlobalBatchSampler: its path, normalised weight, training tokens, and the epochs of
    it that `max_steps` steps read (the sampler's own count)."""
    share = sampler.weights / sampler.weights.sum()
    epochs = sampler.epochs(max_steps)
    return "; ".join(f"{s.name} weight {w:.3g}, {s.train.num_tokens:,} train tokens, {epochs[s.name]:.2f} epochs"
                     for s, w in zip(sampler.sources, share))
