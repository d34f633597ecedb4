"""The fixed validation set and the losses a run logs on it.

The validation rows are fixed for a run: the blend order shares them among the sources by weight, and each
source's windows are evenly spaced over its validation stream, so every evaluation reads the same rows at every
layout. The losses: `val_loss` over the whole set and, with several sources, one per source, `val_loss/<source>`,
so that a blend shows which of its sources the model learns (the sums come from validation_batches_by_source's
parts: token losses and token counts per source, summed over the ranks).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...config.schema import PretrainConfig
from .batches import SampleRows, blend, check_fits, read_micro_batches
from .run_data import read_agreed
from .token_source import TokenSource, TokenStream

__all__ = ["PADDING", "run_validation", "source_labels", "validation_batches", "validation_batches_by_source",
           "validation_record"]


def _validation_rows(sources: list[TokenSource], weights: list[float], seq_len: int,
                     total: int) -> tuple[list[TokenStream], SampleRows]:
    """The validation streams, and the `total` rows of the fixed validation set: the blend order shares them among
    the sources by weight; each source's windows are evenly spaced over its validation stream."""
    streams = [source.val for source in sources]
    for stream in streams:
        check_fits(stream, seq_len, "validation")
    chosen, draws = blend(weights, 0, total)
    offsets = np.empty_like(draws)
    for j, stream in enumerate(streams):
        count = int((chosen == j).sum())
        starts = np.linspace(0, stream.num_tokens - seq_len - 1, count).round().astype(np.int64)
        offsets[chosen == j] = starts[draws[chosen == j]]
    return streams, SampleRows(chosen, draws, np.zeros_like(draws), offsets)


def run_validation(cfg: PretrainConfig, sources: list[TokenSource], weights, dp_rank: int,
                   dp_size: int) -> list[tuple[int, tuple[torch.Tensor, ...]]]:
    """The (source, micro-batch) parts a run of `cfg` evaluates on this data-parallel rank; a data fault on any rank
    is every rank's (run_data.read_agreed)."""
    return read_agreed(lambda: validation_batches_by_source(
        sources, weights, cfg.data.seq_len, cfg.training.micro_batch_size, cfg.training.eval_batches, dp_rank=dp_rank,
        dp_size=dp_size, document_masking=cfg.data.document_masking, aligned=True))


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


PADDING = None  # the source of a part read only to keep the ranks' forwards in step: its loss is not counted


def validation_batches_by_source(sources: list[TokenSource], weights: list[float], seq_len: int, batch_size: int,
                                 num_batches: int, *, dp_rank: int = 0, dp_size: int = 1, document_masking: bool = False,
                                 aligned: bool = False) -> list[tuple[int | None, tuple[torch.Tensor, ...]]]:
    """The rows of `validation_batches`, each rank's share of a batch split by source: (source index,
    micro-batch) pairs, for a validation loss per source (validation_record). A source of one gives the very
    micro-batches of `validation_batches`.

    `aligned` (the trainer's): every data-parallel rank gets as many parts of each batch as the rank with the most
    (each rank works out every rank's count: no communication), the missing ones a one-row part of the batch's first
    row with source PADDING. The data-parallel ranks' forwards then pair up, as FSDP2's all-gathers and each MoE
    layer's all-to-alls need, where a blend (parts per source) or a batch of fewer rows than ranks would otherwise
    leave them unmatched, and no rank is left without a validation micro-batch."""
    return _validation_parts(sources, weights, seq_len, batch_size, num_batches, dp_rank, dp_size,
                             document_masking, by_source=True, aligned=aligned)


def _rank_groups(rows: SampleRows, b: int, batch_size: int, rank: int, dp_size: int,
                 by_source: bool) -> list[SampleRows]:
    """Rank `rank`'s rows of batch `b`, split by source (or whole), each part non-empty."""
    first, last = rank * batch_size // dp_size, (rank + 1) * batch_size // dp_size
    mine = rows[slice(b * batch_size + first, b * batch_size + last)]
    chosen = [mine.source == j for j in np.unique(mine.source)] if by_source else [np.ones(len(mine.source), bool)]
    parts = [SampleRows(*(field[c] for field in (mine.source, mine.draw, mine.epoch, mine.offset))) for c in chosen]
    return [part for part in parts if len(part.source)]


def _validation_parts(sources, weights, seq_len, batch_size, num_batches, dp_rank, dp_size, document_masking,
                      by_source: bool, aligned: bool = False) -> list[tuple[int | None, tuple[torch.Tensor, ...]]]:
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size}).")
    streams, rows = _validation_rows(sources, weights, seq_len, batch_size * num_batches)
    parts = []
    for b in range(num_batches):
        groups = _rank_groups(rows, b, batch_size, dp_rank, dp_size, by_source)
        for part in groups:
            batches = read_micro_batches(streams, part, seq_len + 1, len(part.source), document_masking)
            parts += [(int(part.source[0]) if by_source else -1, batch) for batch in batches]
        most = max(len(_rank_groups(rows, b, batch_size, r, dp_size, by_source)) for r in range(dp_size)) \
            if aligned else 0
        if most > len(groups):
            (padding,) = read_micro_batches(streams, rows[b * batch_size:b * batch_size + 1], seq_len + 1, 1,
                                            document_masking)
            parts += [(PADDING, padding)] * (most - len(groups))
    return parts


def source_labels(names: list[str]) -> list[str]:
    """Each source's name in a metric key: its last path component, or its whole path where two share one."""
    short = [Path(name).name or name for name in names]
    return short if len(set(short)) == len(short) else list(names)


def validation_record(sums: torch.Tensor, names: list[str]) -> dict[str, float]:
    """{"val_loss": mean token loss, "val_loss/<source>": each source's} from `sums` [sources, 2] (token-loss sum,
    token count per source); a source the validation set gave no token has no key, a single source none but
    val_loss."""
    total = sums.sum(dim=0)
    record = {"val_loss": (total[0] / total[1]).item()}
    if len(names) > 1:
        for label, (loss, count) in zip(source_labels(names), sums.tolist()):
            if count > 0:
                record[f"val_loss/{label}"] = loss / count
    return record
