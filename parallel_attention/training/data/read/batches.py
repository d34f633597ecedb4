"""Batches from a blend of token sources, as a pure function of (seed, step).

The global batch of step t is samples [t B, (t + 1) B) of the run (B = training.global_batch_size). Each sample's
source comes from the blend order and its window from that source's epoch order (`sampling`), or, with
`data.sampling: random_windows` (runs started before epochs existed), from a generator seeded with (seed, step).
Data-parallel rank r takes rows [r B/dp, (r + 1) B/dp): ranks of one tensor-parallel group see identical batches,
the union over dp ranks is the same global batch for any layout, and a resumed run, at any data-parallel size,
sees exactly the batches it would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ....transformer.cross_entropy import IGNORE_INDEX
from ....transformer.documents import mask_cross_document_labels
from .sampling import EpochWindows, blend, draws_before
from .token_source import TokenSource, TokenStream

if TYPE_CHECKING:
    from ...config.schema import PretrainConfig

__all__ = ["GlobalBatchSampler", "SampleRows", "SAMPLINGS", "run_sampler", "run_validation", "validation_batches",
           "validation_batches_by_source"]

SAMPLINGS = ("epochs", "random_windows")


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


def _check_fits(stream: TokenStream, seq_len: int, split: str) -> None:
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


def _micro_batches(streams: list[TokenStream], rows: SampleRows, length: int, micro_batch_size: int,
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
            _check_fits(source.train, seq_len, "training")
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
        if self.sampling == "random_windows":  # the previous release's draw, kept exactly for its runs
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + step) % (1 << 63))
            high = self.streams[0].num_tokens - self.seq_len  # last valid start + 1
            offsets = torch.randint(0, high, (self.global_batch_size,), generator=generator).numpy()
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
        return _micro_batches(phase.streams, mine, self.seq_len + 1, micro_batch_size, self.document_masking)

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


def _validation_rows(sources: list[TokenSource], weights: list[float], seq_len: int,
                     total: int) -> tuple[list[TokenStream], SampleRows]:
    """The validation streams, and the `total` rows of the fixed validation set: the blend order shares them among
    the sources by weight; each source's windows are evenly spaced over its validation stream."""
    streams = [source.val for source in sources]
    for stream in streams:
        _check_fits(stream, seq_len, "validation")
    chosen, draws = blend(weights, 0, total)
    offsets = np.empty_like(draws)
    for j, stream in enumerate(streams):
        count = int((chosen == j).sum())
        starts = np.linspace(0, stream.num_tokens - seq_len - 1, count).round().astype(np.int64)
        offsets[chosen == j] = starts[draws[chosen == j]]
    return streams, SampleRows(chosen, draws, np.zeros_like(draws), offsets)


def run_validation(cfg: PretrainConfig, sources: list[TokenSource], weights, dp_rank: int,
                   dp_size: int) -> list[tuple[int, tuple[torch.Tensor, ...]]]:
    """The (source, micro-batch) parts a run of `cfg` evaluates on this data-parallel rank."""
    return validation_batches_by_source(sources, weights, cfg.data.seq_len, cfg.training.micro_batch_size,
                                        cfg.training.eval_batches, dp_rank=dp_rank, dp_size=dp_size,
                                        document_masking=cfg.data.document_masking)


def validation_batches(sources: list[TokenSource], weights: list[float], seq_len: int, batch_size: int,
                       num_batches: int, *, dp_rank: int = 0, dp_size: int = 1,
                       document_masking: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """This data-parallel rank's part of a fixed validation set of `num_batches` x `batch_size` windows.

    None depends on the layout: the trainer passes `batch_size = training.micro_batch_size`, whatever the
    data-parallel size. Rank r takes rows [r*b//dp, (r+1)*b//dp) of every batch (fewer than one row per rank leaves
    some ranks without that batch), so sum the token losses and the token counts over the ranks, then divide, for a
    mean that is the same for every layout.
    """
    return [batch for _, batch in _validation_parts(sources, weights, seq_len, batch_size, num_batches, dp_rank,
                                                    dp_size, document_masking, by_source=False)]


def validation_batches_by_source(sources: list[TokenSource], weights: list[float], seq_len: int, batch_size: int,
                                 num_batches: int, *, dp_rank: int = 0, dp_size: int = 1,
                                 document_masking: bool = False) -> list[tuple[int, tuple[torch.Tensor, ...]]]:
    """The rows of `validation_batches`, each rank's share of a batch split by source: (source index,
    micro-batch) pairs, for a validation loss per source (validation_metrics.py). A source of one gives the very
    micro-batches of `validation_batches`."""
    return _validation_parts(sources, weights, seq_len, batch_size, num_batches, dp_rank, dp_size,
                             document_masking, by_source=True)


def _validation_parts(sources, weights, seq_len, batch_size, num_batches, dp_rank, dp_size, document_masking,
                      by_source: bool) -> list[tuple[int, tuple[torch.Tensor, ...]]]:
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size}).")
    streams, rows = _validation_rows(sources, weights, seq_len, batch_size * num_batches)
    first, last = dp_rank * batch_size // dp_size, (dp_rank + 1) * batch_size // dp_size
    parts = []
    for b in range(num_batches):
        mine = rows[slice(b * batch_size + first, b * batch_size + last)]
        groups = [(int(j), mine.source == j) for j in np.unique(mine.source)] if by_source else \
            [(-1, np.ones(len(mine.source), dtype=bool))]
        for j, chosen in groups:
            part = SampleRows(*(field[chosen] for field in (mine.source, mine.draw, mine.epoch, mine.offset)))
            if len(part.source):
                parts += [(j, batch) for batch in _micro_batches(streams, part, seq_len + 1, len(part.source),
                                                                 document_masking)]
    return parts
