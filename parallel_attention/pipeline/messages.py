"""The messages of a pipeline schedule and when a stage posts and waits for them: the plan the runner follows and
the NCCL model (`nccl_model`) replays, so that the replay tests what runs.

Each message travels on its own one-way link: activations from stage s to s+1 (mod p: the interleaved schedule's
last stage feeds chunk c+1 of the first), gradients from s to s-1 (mod p), one communicator per ordered pair and
direction (`mesh_groups.pipeline_link_groups`). A link carries messages one way only, and every schedule sends a
direction's messages in the order its neighbour receives them (the F order and the B order are the same function
on every stage), so NCCL's in-order stream of one link cannot hold a send behind a receive of the other way.

Stage s between its actions (a `Moment`): post what the last action produced and the receive the next action
needs, each alone on its link; wait for the receive; then wait for the sends of earlier
moments, whose buffers go. So a stage holds one moment's sends beyond what its schedule keeps for its backwards,
whatever m is.
"""

from __future__ import annotations

from typing import NamedTuple

from .schedules import Action

class Link(NamedTuple):
    """A one-way communicator: `kind`s from stage `source` to stage `target` (pipeline group ranks)."""

    kind: str
    source: int
    target: int

    def __str__(self) -> str:
        return f"pipeline {self.kind}s, stage {self.source} -> stage {self.target}"


class Message(NamedTuple):
    """One tensor on a link: micro-batch `micro`'s output of the sender's virtual stage `sent_by` (chunk c of
    stage s is virtual stage c p + s), or its input gradient."""

    link: Link
    micro: int
    sent_by: int


class Moment(NamedTuple):
    """What a stage does with its neighbours before its next action: post `sends` and `receive` (each alone on its
    link), wait for `receive`, then wait for `retire` (earlier sends) and let their buffers go."""

    sends: tuple[Message, ...]
    receive: Message | None
    retire: tuple[Message, ...]

    def posted(self) -> list[Message]:
        """The messages posted, in order: the sends, then the receive (each alone on its link: no order between
        them can block another)."""
        return list(self.sends) + ([self.receive] if self.receive is not None else [])


def _virtual(action: Action, stage: int, p: int) -> int:
    return action.chunk * p + stage


def incoming(action: Action, stage: int, p: int, v: int) -> Message | None:
    """What `action` of `stage` needs from a neighbour before it runs (a forward's input, a backward's output
    gradient), or None."""
    here = _virtual(action, stage, p)
    if action.kind == "F" and here > 0:
        return Message(Link("activation", (stage - 1) % p, stage), action.micro, here - 1)
    if action.kind == "B" and here < p * v - 1:
        return Message(Link("gradient", (stage + 1) % p, stage), action.micro, here + 1)
    return None


def outgoing(action: Action, stage: int, p: int, v: int) -> Message | None:
    """What `action` of `stage` produces for a neighbour (a forward's output, a backward's input gradient), or
    None."""
    here = _virtual(action, stage, p)
    if action.kind == "F" and here < p * v - 1:
        return Message(Link("activation", stage, (stage + 1) % p), action.micro, here)
    if action.kind == "B" and here > 0:
        return Message(Link("gradient", stage, (stage - 1) % p), action.micro, here)
    return None


def moments(actions: list[Action], stage: int, p: int, v: int) -> list[Moment]:
    """The stage's moments: before its first action, then after each (the last retires every send left)."""
    plan, outstanding = [], []
    for k in range(len(actions) + 1):
        produced = outgoing(actions[k - 1], stage, p, v) if k > 0 else None
        sends = (produced,) if produced is not None else ()
        receive = incoming(actions[k], stage, p, v) if k < len(actions) else None
        last = k == len(actions)
        retire = tuple(outstanding) + (sends if last else ())
        outstanding = [] if last else list(sends)
        plan.append(Moment(sends, receive, retire))
    return plan


def buffers_in_flight(actions: list[Action], stage: int, p: int, v: int, training: bool = True) -> int:
    """The most activation-sized tensors `stage` holds for its messages at once under its plan: each received
    activation until its backward (in evaluation, until its forward), each received gradient until its backward,
    each send until it is retired. Bounded whatever m is, except where the schedule holds every micro-batch
    (gpipe)."""
    held, peak = set(), 0
    for k, moment in enumerate(moments(actions, stage, p, v)):
        held |= set(moment.posted())
        peak = max(peak, len(held))
        held -= set(moment.retire)
        action = actions[k] if k < len(actions) else None
        if action is not None and (action.kind == "B" or not training):
            held -= {incoming(action, stage, p, v), incoming(Action("F", action.chunk, action.micro), stage, p, v)}
    return peak
