"""The pipeline schedules as plain lists of actions per pipeline rank: forward (F), backward (B: with the weight
gradient, or the input gradient alone under zero bubble) and weight gradient (W), each of one model chunk on one
micro-batch. p stages, m micro-batches, v chunks per rank; rank s.

    gpipe             every F, then every B
    1f1b              p-s-1 warm-up F, then F/B pairs, then the last B (Narayanan et al. 2021): at most p
                      micro-batches in flight; at p = 1 exactly F0 B0 F1 B1 ..., the step of one process
    interleaved_1f1b  1f1b over v chunks, micro-batches in groups of p (Megatron's order; m a multiple of p)
    zero_bubble       ZB-H1 (Qi et al. 2023): 1f1b whose B computes only the input gradient; up to p-s-1 weight
                      gradients W wait and fill the cool-down bubble

`SCHEDULES` is the one registry: each schedule's builder, its bubble formula (the idle share a step implies when
every stage is equally fast) and that formula's text, and what it asks of the config. The config's choices, the
run summary, the self-check and the runner read it; the runner derives every send and receive from the lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple


class Action(NamedTuple):
    kind: str  # "F", "B" or "W"
    chunk: int
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def gpipe(p: int, m: int, s: int, v: int = 1) -> list[Action]:
    return [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)]


def one_f_one_b(p: int, m: int, s: int, v: int = 1) -> list[Action]:
    warmup = min(p - s - 1, m)
    actions = [Action("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action("F", 0, warmup + i), Action("B", 0, i)]
    return actions + [Action("B", 0, i) for i in range(m - warmup, m)]


def interleaved(p: int, m: int, s: int, v: int) -> list[Action]:
    """Megatron's interleaved order: the k-th forward is chunk (k // p) % v of micro-batch (k // (p v)) p + k % p;
    backwards run the chunks in reverse."""
    total = m * v

    def micro(k: int) -> int:
        return (k // (p * v)) * p + k % p

    forward = [Action("F", (k // p) % v, micro(k)) for k in range(total)]
    backward = [Action("B", v - 1 - (k // p) % v, micro(k)) for k in range(total)]
    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
    actions = forward[:warmup]
    for k in range(total - warmup):
        actions += [forward[warmup + k], backward[k]]
    return actions + backward[total - warmup:]


def zero_bubble(p: int, m: int, s: int, v: int = 1) -> list[Action]:
    """ZB-H1: 1f1b's order with each B computing the input gradient only, so that the backward wave crosses the
    stages faster; up to p-s-1 weight gradients W wait during the steady state, each cool-down B is followed by
    one (filling the wait for the next gradient), and the rest close the step."""
    held, deferred, actions = min(p - s - 1, m), [], []
    for action in one_f_one_b(p, m, s):
        actions.append(action)
        if action.kind == "B":
            deferred.append(Action("W", 0, action.micro))
            if len(deferred) > held or action.micro >= m - held:
                actions.append(deferred.pop(0))
    return actions + deferred


def forward_only(p: int, m: int, s: int, v: int = 1) -> list[Action]:
    """Evaluation: micro-batch by micro-batch, each through this rank's chunks in order (any m: nothing is held
    for a backward, so no interleaving is needed; every stage sends and receives in this same order)."""
    return [Action("F", c, i) for i in range(m) for c in range(v)]


@dataclass(frozen=True)
class Schedule:
    """One schedule: `build(p, m, s, v)` rank s's actions; `bubble(p, m, v)` its idle share, written `formula`;
    `chunked`: runs v >= 2 model chunks per rank (and needs m a multiple of p); `defers_weight_grads`: its B
    computes only the input gradient, a later W the weight gradient."""

    name: str
    build: Callable[[int, int, int, int], list[Action]]
    bubble: Callable[[int, int, int], float]
    formula: str
    chunked: bool = False
    defers_weight_grads: bool = False


def _fill_drain(p: int, m: int, v: int) -> float:
    return (p - 1) / (m + p - 1)


# Zero bubble with the forward, the input gradient and the weight gradient equally long (t each): a 1f1b step
# waits (p-1) 3t of its (m+p-1) 3t; ZB-H1 waits only (p-1) t, the weight gradients filling the rest (Qi et al.)
SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", gpipe, _fill_drain, "(p-1)/(m+p-1)"),
    Schedule("1f1b", one_f_one_b, _fill_drain, "(p-1)/(m+p-1)"),
    Schedule("interleaved_1f1b", interleaved, lambda p, m, v: (p - 1) / (v * m + p - 1), "(p-1)/(v m+p-1)",
             chunked=True),
    Schedule("zero_bubble", zero_bubble, lambda p, m, v: (p - 1) / (3 * m + p - 1), "(p-1)/(3m+p-1)",
             defers_weight_grads=True),
)}
SCHEDULE_NAMES = tuple(SCHEDULES)
DEFAULT_SCHEDULE = "1f1b"  # pp = 1 runs it on one stage: F0 B0 F1 B1 ...
EVALUATION = Schedule("forward_only", forward_only, _fill_drain, "(p-1)/(m+p-1)")


def schedule(name: str) -> Schedule:
    """The registered schedule `name`; ValueError naming the choices."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r} is unknown; choose one of {', '.join(SCHEDULE_NAMES)}.")
    return SCHEDULES[name]


def build_schedule(name: str, p: int, m: int, s: int, v: int = 1) -> list[Action]:
    """Rank s's actions of one step (name "forward_only": evaluation)."""
    return (EVALUATION if name == EVALUATION.name else schedule(name)).build(p, m, s, v)


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> float:
    """The idle share of a step the schedule implies, every stage equally fast."""
    return schedule(name).bubble(p, m, v)
