"""Which documents of a source are held out for validation: one rule, used where data is prepared and where it is read.

Document i is a validation document when i * val_fraction crosses an integer at i + 1: every ~1/val_fraction-th
document, so validation samples the whole source (not its tail, the last files alphabetically), and the choice
depends only on the document count. The rule is applied per source, so a blend's validation set comes from every
source, from documents never trained on. With too few documents for the rule to pick one, the last document is
validation; a source of a single document cannot be split by documents (the reader then cuts its tokens).
"""

from __future__ import annotations

import numpy as np

__all__ = ["validation_mask", "validation_range"]


def validation_mask(num_documents: int, val_fraction: float) -> np.ndarray:
    """bool [num_documents]: True for the validation documents (all False for fewer than two documents)."""
    return validation_range(num_documents, val_fraction, 0, num_documents)


def validation_range(num_documents: int, val_fraction: float, first: int, stop: int) -> np.ndarray:
    """validation_mask(num_documents, val_fraction)[first:stop], in memory proportional to stop - first: a reader
    of 10^9 documents takes it in pieces."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must lie in (0, 1).")
    index = np.arange(first, stop, dtype=np.float64)
    mask = np.floor((index + 1) * val_fraction) > np.floor(index * val_fraction)
    # floor(i * f) never decreases with i, so some document is picked iff floor(n * f) > floor(0 * f) = 0
    if num_documents >= 2 and np.floor(np.float64(num_documents) * val_fraction) == 0 and stop == num_documents > first:
        mask[-1] = True
    if num_documents < 2:
        mask[:] = False
    return mask
