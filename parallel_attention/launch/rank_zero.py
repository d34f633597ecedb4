"""Which process speaks for the job (prints the run's lines, writes its files, prepares its data): global rank 0,
decided one way everywhere."""

from __future__ import annotations

import os

from ..tensor_parallel.parallel_state import get_global_rank, is_distributed


def is_rank_zero() -> bool:
    """Whether this process is the job's rank 0: by the process group once there is one; before it exists (and
    after it is destroyed) by torchrun's RANK, which names the same process (a process outside torchrun is rank 0)."""
    return get_global_rank() == 0 if is_distributed() else os.environ.get("RANK", "0") == "0"
