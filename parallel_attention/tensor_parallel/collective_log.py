"""The collective guard (`parallel.debug_collectives`, `enable_collective_log`): every collective, checked
across the ranks of its group before it runs.

Once enabled, each collective issued through `collectives` becomes a `Call` (op, shape, dtype, group, the call's
number on its group, and the call site: the first stack frame outside this package's collectives and torch) in a
per-rank ring buffer. Before the real collective the ranks of its group all-gather a small signature of it (op,
dtype, shape, number on the group): the guard's own exchange, which runs outside the hooks (through
`collectives.gather_into`, and on a mismatch torch's all_gather_object). A disagreement becomes a report of each
rank's first diverging call, a timeout the calls that led to it. An exchange (a batch of point-to-point operations:
the pipeline's, the ring's) is recorded but not cross-checked: its two ends post it at different points of their
schedules, so a check that waited for the peer's post would make each send a rendezvous (torch's DETAIL check too),
and two pipeline stages that each posted a send first would wait for each other. The pipeline agrees its shapes
before its first exchange and checks each send against them.

What each layer catches (the README's "Failure modes" lists them for users):
- the signature exchange: another op, shape or dtype on one rank at the same point of the group's sequence,
  which is also how an extra or a missing collective on one rank usually shows (the calls after it pair up
  wrongly); CollectiveMismatchError names each rank's call and call site, on every rank of the group;
- the ring buffer: a rank that hangs, dies, or waits on another group (or an extra call whose peers all look
  alike, left unpaired at the end) shows up as CollectiveTimeoutError, with the waiting rank's last calls and
  their numbers on each group, to set beside the other ranks' reports;
- TORCH_DISTRIBUTED_DEBUG=DETAIL (set when the guard is enabled before the groups exist): torch's own
  per-collective check on every group, also for collectives issued outside this package;
- TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DUMP_ON_TIMEOUT (NCCL): the flight recorder, which dumps every
  rank's in-flight NCCL operations when the watchdog times out (init_distributed turns it on for every multi-GPU
  run, guard or not);
- TORCH_NCCL_BLOCKING_WAIT=1 (NCCL): each collective's wait() blocks its CPU thread until the operation is done
  and raises in the caller at the group's timeout (torch then leaves its watchdog's abort off), so a hang on NCCL
  becomes the same CollectiveTimeoutError as on gloo, naming the operation and the group. It serializes the CPU
  with the GPU's communication: one more reason the guard is a debugging tool.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import collectives
from .collectives import CollectiveTimeoutError, named_timeouts
from .mesh_groups import NCCL_DIAGNOSTICS
from .parallel_state import ProcessGroup, describe_group

RECENT_CALLS = 64  # calls kept per rank
SHOWN_CALLS = 8  # calls printed with an error
# torch's own layers, switched on with the guard (an explicit setting in the environment wins)
TORCH_DEBUG_ENV = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", **NCCL_DIAGNOSTICS, "TORCH_NCCL_BLOCKING_WAIT": "1"}

_REGIONS_FILE = os.path.join(os.path.dirname(__file__), "mappings.py")  # the regions' autograd functions
_SKIPPED_FILES = {os.path.join(os.path.dirname(__file__), "collectives.py"), _REGIONS_FILE, __file__,
                  contextlib.__file__}
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


class CollectiveMismatchError(RuntimeError):
    """The ranks of a group issued different collectives (op, shape, dtype, or an extra/missing call)."""


@dataclass(frozen=True)
class Call:
    number: int  # this rank's n-th guarded collective
    op: str
    shape: tuple[int, ...] | None  # None: a pickled object (its size may differ across ranks)
    dtype: str
    group: str  # describe_group's words
    on_group: int  # the n-th call on this group: equal on every rank of the group when they agree
    site: str

    def signature(self) -> list[int]:
        """What every rank of the group must agree on, as int64s (crc32 is the same in every process)."""
        return [zlib.crc32(self.op.encode()), zlib.crc32(self.dtype.encode()), zlib.crc32(str(self.shape).encode()),
                self.on_group]

    def __str__(self) -> str:
        what = "of a pickled object" if self.shape is None else f"of {self.dtype}{list(self.shape)}"
        return f"#{self.number} {self.op} {what} on the {self.group} (call {self.on_group} on it) at {self.site}"


def call_site() -> str:
    """`dir/file.py:line in function` of the first frame outside collectives and torch (and the region
    function whose forward or backward it is, when the collective runs inside one)."""
    frame, region = sys._getframe(1), ""
    while frame is not None and (frame.f_code.co_filename in _SKIPPED_FILES
                                 or frame.f_code.co_filename.startswith(_TORCH_DIR)):
        if frame.f_code.co_filename == _REGIONS_FILE and "ctx" in frame.f_locals:
            region = f" [{type(frame.f_locals['ctx']).__name__.removesuffix('Backward')} {frame.f_code.co_name}]"
        frame = frame.f_back
    if frame is None:  # a backward pass on an autograd engine thread: no Python caller
        return f"<autograd engine thread>{region}"
    where = os.path.join(*frame.f_code.co_filename.split(os.sep)[-2:])
    return f"{where}:{frame.f_lineno} in {frame.f_code.co_name}{region}"


class CollectiveLog:
    """The ring buffer of this rank's recent collectives and the per-group call numbers."""

    def __init__(self, size: int = RECENT_CALLS) -> None:
        self.calls: collections.deque[Call] = collections.deque(maxlen=size)
        self._on_group: dict[int, int] = {}

    def record(self, op: str, x: torch.Tensor | None, group, group_words: str) -> Call:
        on_group = self._on_group[id(group)] = self._on_group.get(id(group), 0) + 1
        number = self.calls[-1].number + 1 if self.calls else 1
        call = Call(number, op, None if x is None else tuple(x.shape),
                    "object" if x is None else str(x.dtype).removeprefix("torch."), group_words, on_group, call_site())
        self.calls.append(call)
        return call

    def before(self, call: Call, n: int = SHOWN_CALLS) -> list[Call]:
        """Up to `n` calls this rank made before `call`, oldest first."""
        return [c for c in self.calls if c.number < call.number][-n:]

    def recent(self, rank: int, n: int = SHOWN_CALLS) -> str:
        lines = [f"    {c}" for c in list(self.calls)[-n:]] or ["    (none)"]
        return f"collective guard: the last {len(lines)} collectives of rank {rank}, oldest first:\n" + "\n".join(lines)


def mismatch_report(group_words: str, ranks: list[int], calls: list[tuple[Call, list[Call]]]) -> str:
    """The message of a CollectiveMismatchError: each rank's first diverging call, then what came before it."""
    lines = [f"the ranks of the {group_words} issued different collectives (op, shape or dtype) at the same point; "
             "first diverging call on each rank:"]
    lines += [f"  rank {rank}: {call}" for rank, (call, _) in zip(ranks, calls)]
    for rank, (_, before) in zip(ranks, calls):
        lines.append(f"  before it, rank {rank}: " + ("; ".join(f"#{c.number} {c.op} at {c.site}" for c in before[-3:])
                                                      or "nothing"))
    return "\n".join(lines)


_GUARD: _Guard | None = None  # the guard enable_collective_log installed in this process


def enable_collective_log(size: int = RECENT_CALLS) -> None:
    """The collective guard, for this process: from now on each collective is recorded (op, shape, dtype, group,
    call site) and its signature all-gathered across its group before it runs, so that diverging ranks raise
    CollectiveMismatchError naming each rank's first diverging call, and a timeout lists the recent calls. Also
    turns on torch's TORCH_DISTRIBUTED_DEBUG=DETAIL, the NCCL flight recorder and NCCL's blocking wait (a hang
    raises in the caller, named) for the groups created afterwards: call it before init_distributed. Costs a small
    all-gather per collective."""
    for name, value in TORCH_DEBUG_ENV.items():
        os.environ.setdefault(name, value)
    dist.set_debug_level_from_env()  # torch read the variable at import
    global _GUARD
    _GUARD = _Guard(CollectiveLog(size))
    collectives.install_hooks(_GUARD.issuing, _GUARD.awaiting, _GUARD.posting)


def disable_collective_log() -> None:
    """Back to the plain timeout hook (for a process that runs several cases, such as the tests' rank pool)."""
    global _GUARD
    _GUARD = None
    collectives.install_hooks()


def active_log() -> CollectiveLog | None:
    """The guard's record of this process's collectives; None while the guard is off."""
    return None if _GUARD is None else _GUARD.log


class _Guard:
    """The contexts the guard puts around each collective, each exchange's post and each asynchronous wait()."""

    def __init__(self, log: CollectiveLog) -> None:
        self.log = log

    @contextlib.contextmanager
    def issuing(self, op: str, x: torch.Tensor | None, group: ProcessGroup | None):
        """Record the call, check it against the group's other ranks, then run it (a timeout lists recent calls)."""
        call = self.log.record(op, x, group, describe_group(group))
        with self.awaiting(op, group):
            calls = self._exchange_signatures(call, x, group)
        if calls is not None:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(calls)))
            raise CollectiveMismatchError(mismatch_report(call.group, ranks, calls))
        with self.awaiting(op, group):
            yield

    @contextlib.contextmanager
    def posting(self, op: str, x: torch.Tensor | None, group: ProcessGroup | None):
        """Record the exchange, then post it (a timeout lists recent calls); no cross-check (the module's
        docstring says why)."""
        self.log.record(op, x, group, describe_group(group))
        with self.awaiting(op, group):
            yield

    @contextlib.contextmanager
    def awaiting(self, op: str, group: ProcessGroup | None):
        """named_timeouts, and a timeout lists this rank's recent calls."""
        try:
            with named_timeouts(op, group):
                yield
        except CollectiveTimeoutError as error:
            raise CollectiveTimeoutError(f"{error}\n{self.log.recent(dist.get_rank())}") from error

    def _exchange_signatures(self, call: Call, x: torch.Tensor | None, group: ProcessGroup | None) -> list | None:
        """None if every rank of the group issues a call of this signature; else every rank's call and the ones
        before it (every rank of the group sees the disagreement, so every rank joins that second gather)."""
        nccl = x is None and dist.get_backend(group) == "nccl"
        device = x.device if x is not None else torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
        mine = torch.tensor(call.signature(), dtype=torch.int64, device=device)
        gathered = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.int64, device=device)
        collectives.gather_into(gathered, mine, group)
        signatures = gathered.view(-1, mine.numel()).tolist()
        if all(s == signatures[0] for s in signatures):
            return None
        calls = [None] * len(signatures)
        dist.all_gather_object(calls, (call, self.log.before(call, 3)), group=group)
        return calls
