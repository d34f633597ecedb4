"""The loader off the critical path: the next step's micro-batches are read on a background thread.

Reading a step's windows (memory-mapped pages, maybe from a network filesystem, plus the id checks) costs
milliseconds to seconds; done inline it adds to every step. One worker thread reads step t + 1 while step t
computes (numpy and the page faults release the GIL), and `get` reports how long the step still waited.
A batch is a pure function of the step, so reading ahead never changes what a step trains on. A data fault on
one rank (a chunk that fails its hash) ends every rank with its message (run_data.read_agreed: one small all-reduce
a step), instead of leaving the others to a backend error in their next collective.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generic, TypeVar

from .run_data import read_agreed

__all__ = ["BatchPrefetcher"]

T = TypeVar("T")


class BatchPrefetcher(Generic[T]):
    """`get(step)` returns read(step) and the seconds spent waiting for it, then starts reading step + 1."""

    def __init__(self, read: Callable[[int], T]) -> None:
        self._read = read
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-prefetch")
        self._ahead: tuple[int, Future] | None = None

    def get(self, step: int) -> tuple[T, float]:
        started = time.perf_counter()
        if self._ahead is not None and self._ahead[0] == step:
            future = self._ahead[1]
        else:  # the first step, or a jump (a resume): read it now
            self._cancel()
            future = self._pool.submit(self._read, step)
        batches = read_agreed(future.result)  # a reading error is raised here, in the training thread, on every rank
        waited = time.perf_counter() - started
        self._ahead = (step + 1, self._pool.submit(self._read, step + 1))
        return batches, waited

    def _cancel(self) -> None:
        if self._ahead is not None:
            self._ahead[1].cancel()
            self._ahead = None

    def close(self) -> None:
        """Stop reading ahead and join the thread (every process exits when its work is done)."""
        self._cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
