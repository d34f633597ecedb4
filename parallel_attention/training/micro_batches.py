"""A step's micro-batches as the trainer hands them to the step: checked and on the device, and where each sits in
the step's global batch (its dropout coordinates)."""

from __future__ import annotations

import torch

from ..transformer.cross_entropy import check_ids, check_labels


def on_device(batches: list[tuple], vocab_size: int, device: torch.device) -> list[tuple]:
    """Check a step's micro-batches on the host (token ids and labels inside the vocabulary: ValueError naming
    the first bad one), then move them: from pinned memory without blocking on CUDA. Run where they are read (the
    prefetch thread), so that the step itself never waits for the host."""
    for tokens, labels, *_ in batches:
        check_ids(tokens, vocab_size, "token")
        check_labels(labels, vocab_size)
    if device.type == "cpu":
        return batches
    return [tuple(t.pin_memory().to(device, non_blocking=True) for t in batch) for batch in batches]


def first_sample(training, dp_rank: int, dp_size: int, index: int) -> int:
    """The index in the step's global batch of the first row of this data-parallel rank's micro-batch `index`:
    layout-invariant dropout hashes its masks from it, so they do not depend on dp, the micro-batch size or pp."""
    return dp_rank * (training.global_batch_size // dp_size) + index * training.micro_batch_size
