"""Count the collectives a block of code issues, by wrapping torch.distributed's functions (every collective of
the package goes through them)."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
               "reduce_scatter_single", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
               "all_to_all", "all_to_all_single", "barrier", "send", "recv", "isend", "irecv")
# torch >= 2.10 renamed the tensor forms; count both spellings under the older, longer-lived names
ALIASES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


@contextlib.contextmanager
def count_collectives():
    """Yields a Counter of collective name -> calls made inside the block (on any group)."""
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[ALIASES.get(name, name)] += 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
