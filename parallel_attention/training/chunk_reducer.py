"""The data-parallel average of a pipeline stage's gradients, overlapping each chunk's last backward.

DDP's reducer assumes one forward, then its backward; a pipeline stage runs several forwards before their
backwards (1f1b holds up to p), so DDP cannot follow it. This reducer keeps DDP's idea: each chunk's parameters in
buckets (reverse order of registration, the order a backward finishes them); during the chunk's last backward of
the step, a bucket's all-reduce starts (async, through `collectives`) as soon as the post-accumulate-grad hook of
its last parameter fires, so the reduction overlaps the rest of that backward, the other chunks' work and the
schedule's last exchanges. `finish` starts the buckets that never completed (parameters without a gradient in that
backward, or a schedule that defers weight gradients to W, whose B arms nothing), waits, and divides.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..pipeline.micro_batch_step import GradientSync
from ..tensor_parallel.collectives import all_reduce
from ..tensor_parallel.parallel_state import ProcessGroup, group_size
from .gradients import average_into, flat_buckets

BUCKET_MB = 25  # as DDP's default: the first buckets start early in the backward


class ChunkReducer(GradientSync):
    """The gradient sync of a pipeline stage (data_parallel.data_parallel_step): `chunks[c]` the parameters chunk
    c's backward accumulates into."""

    def __init__(self, chunks: list[list[nn.Parameter]], group: ProcessGroup | None,
                 bucket_mb: float = BUCKET_MB) -> None:
        self.group, self.world = group, group_size(group)
        self.buckets, self.chunk_of_bucket = [], []
        for c, params in enumerate(chunks):
            for bucket in flat_buckets([p for p in reversed(params) if p.requires_grad], bucket_mb):
                self.buckets.append(bucket)
                self.chunk_of_bucket.append(c)
        self.bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.armed: int | None = None
        self._start_step()
        for bucket in self.buckets:
            for param in bucket:
                param.register_post_accumulate_grad_hook(self._accumulated)

    def _start_step(self) -> None:
        self.waiting = [len(bucket) for bucket in self.buckets]  # parameters each bucket still waits for
        self.pending: dict[int, object] = {}  # bucket -> its posted all-reduce

    def _accumulated(self, param: nn.Parameter) -> None:
        k = self.bucket_of[id(param)]
        if self.chunk_of_bucket[k] != self.armed or k in self.pending:
            return
        self.waiting[k] -= 1
        if self.waiting[k] == 0:
            self._post(k)

    def _post(self, k: int) -> None:
        grads = [p.grad for p in self.buckets[k] if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.pending[k] = (grads, all_reduce(flat, self.group, async_op=True))

    @contextlib.contextmanager
    def backward(self, chunk: int, last: bool):
        """The chunk's last backward arms its buckets' hooks; any other accumulates only."""
        self.armed = chunk if last else None
        try:
            yield
        finally:
            self.armed = None

    def finish(self) -> None:
        """Post what is left, wait for every bucket, and leave each gradient the average over the group."""
        for k in range(len(self.buckets)):
            if k not in self.pending:
                self._post(k)
        for grads, posted in self.pending.values():
            average_into(grads, posted.wait(), self.world)
        self._start_step()
