"""Count the collectives a block of code issues, by wrapping torch.distributed's functions for its duration (every
collective of the package goes through them): the one counter of the self-check and the tests.

Names are torch's, the tensor forms under their older, longer-lived spellings (torch >= 2.10 added
`all_gather_single` / `reduce_scatter_single`). Given `group`, a call on any other group (or with none named)
counts under `name@other-group`, so a stray collective on the wrong group cannot hide among the right ones. A
`batch_isend_irecv` counts once under its own name and each of its operations under `isend` / `irecv`.
`count_collective_bytes` counts the bytes each rank hands to them instead (half precision stays half: asserted).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
               "reduce_scatter_single", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
               "all_to_all", "all_to_all_single", "barrier", "send", "recv", "isend", "irecv")
TENSOR_FORMS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single")
ALIASES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def _sent(name: str, args, kwargs) -> torch.Tensor | None:
    """The tensor this rank hands to collective `name` (what it moves): the input, not the output buffer."""
    if name in ("all_reduce", "broadcast", "reduce", "send", "isend"):
        return args[0] if args else kwargs.get("tensor")
    if name in TENSOR_FORMS:
        return args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
    return None


@contextlib.contextmanager
def _wrapped(group, record):
    """Every collective issued inside the block calls record(name, tensor it sends or None) first; a call on another
    group than `group` (when given) under `name@other-group`."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        counted_as = ALIASES.get(name, name)

        def counted(*args, **kwargs):
            other = group is not None and kwargs.get("group") is not group
            record(f"{counted_as}@other-group" if other else counted_as, _sent(name, args, kwargs))
            return fn(*args, **kwargs)
        return counted

    batch = dist.batch_isend_irecv

    def counted_batch(ops):
        """One batch_isend_irecv, and each of its operations under isend / irecv as if issued alone."""
        record("batch_isend_irecv", None)
        for p2p in ops:
            name = "isend" if p2p.op is dist.distributed_c10d.isend else "irecv"
            other = group is not None and p2p.group is not group
            record(f"{name}@other-group" if other else name, p2p.tensor if name == "isend" else None)
        return batch(ops)

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    dist.batch_isend_irecv = counted_batch
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        dist.batch_isend_irecv = batch


@contextlib.contextmanager
def count_collectives(group=None):
    """Yields a Counter of collective name -> calls made inside the block (on any group when `group` is None)."""
    counts: Counter = Counter()
    with _wrapped(group, lambda name, _: counts.update((name,))):
        yield counts


@contextlib.contextmanager
def count_collective_bytes(group=None):
    """Yields a Counter of (collective name, dtype) -> bytes this rank handed to it inside the block: the input of
    an all-reduce, all-gather or reduce-scatter, each isend's tensor (receives count nothing: the sender counts)."""
    moved: Counter = Counter()

    def record(name, tensor):
        if tensor is not None:
            moved[name, tensor.dtype] += tensor.numel() * tensor.element_size()
    with _wrapped(group, record):
        yield moved
