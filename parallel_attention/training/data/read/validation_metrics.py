"""The validation losses a run logs: `val_loss` over the whole validation set, and with several sources one per
source, `val_loss/<source>`, so that a blend shows which of its sources the model learns (the sums come from
batches.validation_batches_by_source's parts: token losses and token counts per source, summed over the ranks)."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["source_labels", "validation_record"]


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
