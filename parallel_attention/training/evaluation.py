"""The validation loss: the mean loss per token over the fixed validation windows, the same at every layout, and
each source's of a blend."""

from __future__ import annotations

import torch

from ..tensor_parallel import parallel_state as ps
from ..tensor_parallel.collectives import all_reduce
from ..transformer.cross_entropy import IGNORE_INDEX
from .data.read.validation import PADDING, validation_record
from .step import validation_losses


@torch.no_grad()
def evaluate(run) -> dict[str, float]:
    """{"val_loss": ..., "val_loss/<source>": ...}: token-loss sums and token counts per source over this rank's
    validation micro-batches (the forward-only schedule through the pipeline's stages), summed over the
    data-parallel ranks, then divided."""
    run.model.eval()
    sums = torch.zeros(len(run.sampler.sources), 2, dtype=torch.float64, device=run.device)  # [losses, tokens]
    means = validation_losses(run)
    for mean, (source, batch) in zip(means, run.val_batches):
        if source is PADDING:  # run to keep the data-parallel ranks' forwards in step (FSDP2, MoE); not a row
            continue
        count = float((batch[1] != IGNORE_INDEX).sum())
        sums[source] += torch.stack([mean * count, torch.tensor(count, dtype=torch.float64, device=run.device)])
    run.model.train()
    all_reduce(sums, ps.get_data_parallel_group())
    return validation_record(sums, [source.name for source in run.sampler.sources])
