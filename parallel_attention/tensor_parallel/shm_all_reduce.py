"""A sum all-reduce through one shared buffer, for the ranks of a gloo group on one host (opt-in, CPU).

Why: gloo carries an all-reduce over loopback TCP and its own threads. Between two processes on the 2-core
development host a 2 MiB float32 sum takes 3.8 ms through gloo and 1.2 ms through a shared buffer
(docs/benchmarks.md, "fourth pass"). DeepSpeed, vLLM and SGLang ship shared-memory all-reduces for CPU tensor
parallelism; torch's gloo has none (its shared-memory all-reduce was merged, then reverted).

Opt-in with PARALLEL_ATTENTION_SHM_ALL_REDUCE=1, set alike on every rank (torchrun passes the environment on).
Off by default: a collective that bypasses torch.distributed is invisible to whatever hooks it (profilers,
TORCH_DISTRIBUTED_DEBUG, counters that wrap `dist.all_reduce`). collectives.py sets a group up at its first
sum all-reduce (a handshake over the group) and falls back to gloo where the ranks do not share memory.

Protocol, group rank r of n, call number k (two halves of the buffer, by k's parity):
    post:    wait until done[i] >= k - 2 for every i       nobody still reads the half this call writes
             slot[k % 2][r] = x;  ready[r] = k
    finish:  wait until ready[i] >= k for every i           (async_op: at the handle's wait())
             x = slot[k % 2][0] + slot[k % 2][1] + ...     rank order: every rank holds bitwise the same sum
             done[r] = k
A tensor larger than a slot goes through slot-sized chunks, one call number each. x86-64 only: there a store
becomes visible to other cores in program order, which the flags rely on; other machines keep gloo.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import mmap
import os
import platform
import secrets
import time
import uuid

import torch
import torch.distributed as dist

ENV = "PARALLEL_ATTENTION_SHM_ALL_REDUCE"
SLOT_BYTES = 4 << 20  # per rank and half: 4 n slots of 4 MiB in all (16 MiB of /dev/shm for two ranks)
_HEADER = 4096  # flags (ready[n], done[n] as int64) at 0, the handshake token at _TOKEN_AT; slots after
_TOKEN_AT = 2048
_DIRECTORY = "/dev/shm"
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64)


def requested() -> bool:
    return os.environ.get(ENV, "0") == "1"


def machine_supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(_DIRECTORY)


def accepts(x: torch.Tensor) -> bool:
    """Whether a tensor can take this path (every rank decides alike: the tensors' signatures agree)."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and x.is_contiguous() and x.numel() > 0


class SharedMemoryAllReduce:
    """One group's buffer, mapped by each of its ranks. `start(x)` posts x and returns a handle whose `wait()`
    leaves the group's sum in x (the caller leaves x alone meanwhile); `self(x)` is start(x).wait().

    Posting and summing are separate steps so that an async_op caller (overlap's dgrad) computes between them:
    a rank that runs ahead posts and goes on, instead of spinning at the post until the slower rank arrives.
    Calls finish in the order they were posted; at most two are in flight (one per half): a third post first
    finishes this rank's oldest."""

    def __init__(self, mapping: mmap.mmap, rank: int, size: int, timeout_s: float) -> None:
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self._mapping = mapping
        self._flags = memoryview(mapping)[:16 * size].cast("q")
        self._data = torch.frombuffer(mapping, dtype=torch.uint8, offset=_HEADER, count=2 * size * SLOT_BYTES)
        self._posted = self._finished = 0  # call numbers
        self._in_flight: collections.deque = collections.deque()  # (call, chunk, its slots), oldest first

    @torch.compiler.disable  # eager under torch.compile: dynamo must not trace the buffer's flags and slots
    def start(self, x: torch.Tensor) -> _Pending:
        flat = x.view(-1)
        step = SLOT_BYTES // x.element_size()
        for begin in range(0, flat.numel(), step):
            self._post(flat[begin:begin + step])
        return _Pending(self, self._posted)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.start(x).wait()
        return x

    def finish_through(self, call: int) -> None:
        while self._finished < call:
            self._finish_oldest()

    def _post(self, chunk: torch.Tensor) -> None:
        call, n = self._posted + 1, self.size
        self.finish_through(call - 2)  # this rank's own read of the half this call writes
        slots = [self._slot(call % 2, i, chunk) for i in range(n)]
        self._wait_for(range(n, 2 * n), call - 2, "finish reading")
        slots[self.rank].copy_(chunk)
        self._flags[self.rank] = call
        self._in_flight.append((call, chunk, slots))
        self._posted = call

    def _finish_oldest(self) -> None:
        call, chunk, slots = self._in_flight.popleft()
        self._wait_for(range(self.size), call, "write its part")
        torch.add(slots[0], slots[1], out=chunk)
        for slot in slots[2:]:
            chunk.add_(slot)
        self._flags[self.size + self.rank] = call
        self._finished = call

    def _slot(self, half: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        start = (half * self.size + rank) * SLOT_BYTES
        return self._data[start:start + like.numel() * like.element_size()].view(like.dtype)

    def _wait_for(self, indices: range, target: int, what: str) -> None:
        """Spin (yielding the core) until every flag in `indices` reaches `target`; then sleep-poll, up to the
        timeout, so that a rank that waits long leaves the cores to the ranks still computing."""
        flags, spins, deadline = self._flags, 0, None
        while not all(flags[i] >= target for i in indices):
            spins += 1
            if spins < 2000:
                os.sched_yield()
                continue
            deadline = deadline or time.monotonic() + self.timeout_s
            if time.monotonic() > deadline:
                late = [i % self.size for i in indices if flags[i] < target]
                raise RuntimeError(f"shared-memory all-reduce timed out after {self.timeout_s:.0f} s waiting for "
                                   f"group ranks {late} to {what} call {target}")
            time.sleep(50e-6)


class _Pending:
    """The work handle of `start`: wait() finishes this rank's calls through the last chunk of its tensor."""

    def __init__(self, buffer: SharedMemoryAllReduce, call: int) -> None:
        self.buffer, self.call = buffer, call

    @torch.compiler.disable  # likewise: a traced wait could bake the flags' spin into a graph
    def wait(self, timeout=None) -> bool:
        self.buffer.finish_through(self.call)
        return True


def buffer_bytes(size: int) -> int:
    return _HEADER + 2 * size * SLOT_BYTES


def create(size: int) -> tuple[str, bytes] | None:
    """Group rank 0: a fresh zeroed buffer file and the token the other ranks must read back from it; None where
    /dev/shm lacks room (the handshake then keeps gloo)."""
    stats = os.statvfs(_DIRECTORY)
    if stats.f_bavail * stats.f_frsize < 2 * buffer_bytes(size):
        return None
    path, token = os.path.join(_DIRECTORY, f"parallel_attention_{uuid.uuid4().hex}"), secrets.token_bytes(16)
    with open(path, "wb") as f:
        f.truncate(buffer_bytes(size))
        f.seek(_TOKEN_AT)
        f.write(token)
    return path, token


def attach(offer: tuple[str, bytes] | None, rank: int, size: int, timeout_s: float) -> SharedMemoryAllReduce | None:
    """Map the buffer rank 0 offered; None where this rank cannot see it (another host or /dev/shm namespace)."""
    if offer is None:
        return None
    path, token = offer
    try:
        with open(path, "r+b") as f:
            mapping = mmap.mmap(f.fileno(), buffer_bytes(size))
    except OSError:
        return None
    if mapping[_TOKEN_AT:_TOKEN_AT + len(token)] != token:
        return None
    return SharedMemoryAllReduce(mapping, rank, size, timeout_s)


def unlink(offer: tuple[str, bytes] | None) -> None:
    """Remove the file once every rank has mapped it: the mappings live on, and nothing is left behind."""
    if offer is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(offer[0])


_BY_GROUP: dict = {}  # group -> its SharedMemoryAllReduce, or None where the handshake kept gloo


def lookup(group) -> tuple[bool, SharedMemoryAllReduce | None]:
    """(whether the group has been through the handshake, its buffer or None)."""
    return group in _BY_GROUP, _BY_GROUP.get(group)


def register(group, buffer: SharedMemoryAllReduce | None) -> None:
    _BY_GROUP[group] = buffer


def set_up(group, rank: int, size: int, eligible: bool, gather, timeout) -> SharedMemoryAllReduce | None:
    """The handshake, collective over `group` (`gather(obj)` returns every group rank's obj): rank 0 offers a
    buffer file, every rank maps it and reads back its token, and the group uses it only if all ranks could;
    then the file is removed. Not eligible (one rank, not gloo, not x86-64): gloo, without a handshake."""
    if not (eligible and machine_supported()):
        register(group, None)
        return None
    offer = gather(create(size) if rank == 0 else None)[0]
    buffer = attach(offer, rank, size, timeout.total_seconds() if timeout else 1800.0)
    everyone = all(gather(buffer is not None))
    if rank == 0:
        unlink(offer)
    buffer = buffer if everyone else None
    register(group, buffer)
    return buffer


def group_buffer(group, all_gather_objects, timeout) -> SharedMemoryAllReduce | None:
    """The group's (a process group's, not None) buffer, None where it keeps gloo; its first use is the handshake
    (`set_up`, gathering with `all_gather_objects(obj, group=...)`, within `timeout()`): the arguments are bound
    only then, off the all-reduce's hot path. torch's own rank and size calls: parallel_state imports this
    module, so this one does not import it back."""
    done, buffer = lookup(group)
    if done:
        return buffer
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    gather = functools.partial(all_gather_objects, group=group)
    return set_up(group, rank, size, size > 1 and dist.get_backend(group) == "gloo", gather, timeout())


@contextlib.contextmanager
def gloo_only(group):
    """Inside: the group's all-reduces go through gloo (benchmarks time both paths in the same rounds)."""
    set_up, buffer = lookup(group)
    register(group, None)
    try:
        yield
    finally:
        if set_up:
            register(group, buffer)
        else:
            _BY_GROUP.pop(group, None)  # not set up before: the handshake still happens at the next call


def release_all() -> None:
    """Forget every group's buffer (destroy_model_parallel): each mapping goes with its last tensor view."""
    _BY_GROUP.clear()
