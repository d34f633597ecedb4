"""The validation loss: the mean loss per token over the fixed validation windows, the same at every layout."""

from __future__ import annotations

import torch

from ..tensor_parallel import parallel_state as ps
from ..tensor_parallel.collectives import all_reduce_
from ..transformer.cross_entropy import IGNORE_INDEX
from .micro_batches import model_inputs
from .pipeline_step import pipeline_validation_sums


@torch.no_grad()
def evaluate(run) -> float:
    """Token-loss sums and token counts over this rank's validation batches (through the pipeline's stages at
    pp > 1), summed over the data-parallel ranks, then divided."""
    run.model.eval()
    if run.pipeline_eval is not None:
        sums = pipeline_validation_sums(run)
    else:
        sums = torch.zeros(2, dtype=torch.float64, device=run.device)  # [sum of token losses, tokens]
        for batch in run.val_batches:
            with run.precision.autocast():
                mean = run.model(**model_inputs(batch, run.device)).double()
            count = float((batch[1] != IGNORE_INDEX).sum())
            sums += torch.stack([mean * count, torch.tensor(count, dtype=torch.float64, device=run.device)])
    run.model.train()
    all_reduce_(sums, ps.get_data_parallel_group())
    return (sums[0] / sums[1]).item()
