"""Count the collectives a block of code issues, by wrapping torch.distributed's functions for its duration (every
collective of the package goes through them): the one counter of the self-check and the tests.

Names are torch's, the tensor forms under their older, longer-lived spellings (torch >= 2.10 added
`all_gather_single` / `reduce_scatter_single`). Given `group`, a call on any other group (or with none named)
counts under `name@other-group`, so a stray collective on the wrong group cannot hide among the right ones. A
`batch_isend_irecv` counts once under its own name and each of its operations under `isend` / `irecv`.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
               "reduce_scatter_single", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
               "all_to_all", "all_to_all_single", "barrier", "send", "recv", "isend", "irecv")
ALIASES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


@contextlib.contextmanager
def count_collectives(group=None):
    """Yields a Counter of collective name -> calls made inside the block (on any group when `group` is None)."""
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        counted_as = ALIASES.get(name, name)

        def counted(*args, **kwargs):
            other = group is not None and kwargs.get("group") is not group
            counts[f"{counted_as}@other-group" if other else counted_as] += 1
            return fn(*args, **kwargs)
        return counted

    batch = dist.batch_isend_irecv

    def counted_batch(ops):
        """One batch_isend_irecv, and each of its operations under isend / irecv as if issued alone."""
        counts["batch_isend_irecv"] += 1
        for p2p in ops:
            name = "isend" if p2p.op is dist.distributed_c10d.isend else "irecv"
            counts[f"{name}@other-group" if group is not None and p2p.group is not group else name] += 1
        return batch(ops)

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    dist.batch_isend_irecv = counted_batch
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        dist.batch_isend_irecv = batch
