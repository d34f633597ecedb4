"""A model of how NCCL runs a pipeline step's point-to-point messages, to prove on a CPU that a plan cannot hang
on GPUs at any message size.

What it models (NCCL's semantics for messages larger than its buffers):
- one in-order stream per communicator and rank: a group call (one `batch_isend_irecv`) starts only when the one
  before it on that communicator has completed, and only once the rank's compute stream has reached the point where
  it was posted;
- rendezvous sends: a send completes only together with the peer's matching receive (the k-th send from a to b on a
  communicator matches the k-th receive at b from a), both in group calls that have started;
- the compute stream waits as the runner waits (`wait()`), and posts nothing past a wait that has not completed.
gloo is the same without the in-order streams (each operation runs on its own). The collective guard records
exchanges without a cross-rank check (`collective_log` says why) and turns on NCCL's blocking wait, under which the
CPU waits where the compute stream does: what this model follows already.

A rank's program is a list of `Post` and `Wait`; `replay` runs the programs of every rank and returns None, or a
`Deadlock` that says what each stuck rank waits for. `runner_program` is the runner's own plan
(`messages.moments`) as such a program.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Hashable, NamedTuple

from .messages import Moment


class Post(NamedTuple):
    """One group call on `comm`: each op ("send" or "recv", peer rank, message)."""

    comm: Hashable
    ops: tuple[tuple[str, int, Hashable], ...]


class Wait(NamedTuple):
    """The compute stream (and the CPU) waits for this rank's operations on these messages."""

    messages: tuple[Hashable, ...]


class Deadlock(NamedTuple):
    stuck: dict  # rank -> what its program waits at
    text: str


class MismatchedMessage(AssertionError):
    """A receive matched a send of another message: its tensor would land in the wrong buffer."""


def runner_program(plan: list[Moment], stage: int) -> list[Post | Wait]:
    """What the runner does with `plan` (messages.moments) on `stage`: post each message of a moment alone on its
    link, wait for the receive, then for the sends it retires."""
    program: list[Post | Wait] = []
    for moment in plan:
        for message in moment.posted():
            link = message.link
            sending = link.source == stage
            program.append(Post(link, (("send" if sending else "recv", link.target if sending else link.source,
                                        message),)))
        if moment.receive is not None:
            program.append(Wait((moment.receive,)))
        if moment.retire:
            program.append(Wait(moment.retire))
    return program


class _Replay:
    def __init__(self, programs: dict[int, list], in_order: bool) -> None:
        self.programs, self.in_order = programs, in_order
        self.pc = {rank: 0 for rank in programs}
        self.streams: dict[Hashable, deque] = defaultdict(deque)  # stream -> group calls (lists of op keys)
        self.queued = defaultdict(list)  # (comm, source, target, "send"/"recv") -> op keys in posted order
        self.position: dict[tuple, tuple] = {}  # op key -> (channel, index)
        self.done: set = set()

    def _current(self, rank: int):
        program = self.programs[rank]
        return program[self.pc[rank]] if self.pc[rank] < len(program) else None

    def _post(self, rank: int, post: Post) -> None:
        keys = []
        for direction, peer, message in post.ops:
            key = (rank, direction, message)
            source, target = (rank, peer) if direction == "send" else (peer, rank)
            channel = (post.comm, source, target, direction)
            self.position[key] = (channel, len(self.queued[channel]))
            self.queued[channel].append(key)
            keys.append(key)
        if self.in_order:
            self.streams[(rank, post.comm)].append(keys)
        else:
            for key in keys:
                self.streams[key].append([key])

    def _advance(self, rank: int) -> bool:
        moved = False
        while (op := self._current(rank)) is not None:
            if isinstance(op, Post):
                self._post(rank, op)
            elif not all(self._finished(rank, message) for message in op.messages):
                break
            self.pc[rank] += 1
            moved = True
        return moved

    def _finished(self, rank: int, message) -> bool:
        return (rank, "send", message) in self.done or (rank, "recv", message) in self.done

    def _match(self) -> bool:
        active = {key for stream in self.streams.values() if stream for key in stream[0]}
        moved = False
        for key in list(active):
            channel, index = self.position[key]
            if key in self.done or channel[3] != "send":
                continue
            receives = self.queued[channel[:3] + ("recv",)]
            if index < len(receives) and receives[index] in active:
                if receives[index][2] != key[2]:
                    raise MismatchedMessage(f"on {channel[0]} the receive of {receives[index][2]} matched the send "
                                            f"of {key[2]}")
                self.done |= {key, receives[index]}
                moved = True
        for stream in self.streams.values():
            while stream and all(key in self.done for key in stream[0]):
                stream.popleft()
        return moved

    def run(self) -> Deadlock | None:
        while True:
            moved = any([self._advance(rank) for rank in self.programs])
            if not (self._match() or moved):
                break
        stuck = {rank: self._current(rank) for rank in self.programs if self._current(rank) is not None}
        unfinished = sorted(map(str, set(self.position) - self.done))  # posted, never matched: a message left over
        if not stuck and not unfinished:
            return None
        heads = {stream: stream_ops[0] for stream, stream_ops in self.streams.items() if stream_ops}
        text = "\n".join([f"rank {rank} waits at {op}" for rank, op in stuck.items()]
                         + [f"  stream {stream} is held by {ops}" for stream, ops in heads.items()]
                         + [f"  never completed: {op}" for op in unfinished])
        return Deadlock(stuck, text)


def replay(programs: dict[int, list[Post | Wait]], in_order: bool = True) -> Deadlock | None:
    """Run every rank's program under NCCL's semantics (in_order: one stream per communicator; False: gloo's
    independent operations). None when every program finishes; else the Deadlock."""
    return _Replay(programs, in_order).run()
