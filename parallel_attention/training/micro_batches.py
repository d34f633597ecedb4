"""A micro-batch as the model takes it, and where it sits in the step's global batch (its dropout coordinates)."""

from __future__ import annotations

import torch


def model_inputs(batch: tuple, device: torch.device) -> dict:
    """A micro-batch (tokens, labels[, document_ids]) as the model's keyword arguments, on `device`."""
    return {name: t.to(device) for name, t in zip(("tokens", "labels", "document_ids"), batch)}


def first_sample(training, dp_rank: int, dp_size: int, index: int) -> int:
    """The index in the step's global batch of the first row of this data-parallel rank's micro-batch `index`:
    layout-invariant dropout hashes its masks from it, so they do not depend on dp, the micro-batch size or pp."""
    return dp_rank * (training.global_batch_size // dp_size) + index * training.micro_batch_size
