"""The pipeline schedules as plain lists of actions per pipeline rank: forward (F), backward (B: with the weight
gradient, or the input gradient alone under zero bubble) and weight gradient (W), each of one model chunk on one
micro-batch. p stages, m micro-batches, v chunks per rank; rank s.

    gpipe             every F, then every B                                        bubble (p-1)/(m+p-1)
    1f1b              p-s-1 warm-up F, then F/B pairs, then the last B             (p-1)/(m+p-1), at most
                      (Narayanan et al. 2021): at most p micro-batches in flight   p micro-batches held
    interleaved_1f1b  1f1b over v chunks, micro-batches in groups of p             (p-1)/(v m+p-1)
                      (Megatron's order; m a multiple of p)
    zero_bubble       ZB-H1 (Qi et al. 2023): 1f1b whose B computes only the input   (p-1)/(3m+p-1) with
                      gradient; up to p-s-1 weight gradients W wait and fill the     F = B = W
                      cool-down bubble

The runner (`runner.py`) derives every send and receive from these lists; the same lists give the bubble formula
and the timeline's expected picture.
"""

from __future__ import annotations

from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


class Action(NamedTuple):
    kind: str  # "F", "B" or "W"
    chunk: int
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def gpipe(p: int, m: int, s: int) -> list[Action]:
    return [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)]


def one_f_one_b(p: int, m: int, s: int) -> list[Action]:
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


def zero_bubble(p: int, m: int, s: int) -> list[Action]:
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


def build_schedule(name: str, p: int, m: int, s: int, v: int = 1) -> list[Action]:
    """Rank s's actions of one step (name "forward_only": evaluation)."""
    if name == "forward_only":
        return forward_only(p, m, s, v)
    if name == "interleaved_1f1b":
        return interleaved(p, m, s, v)
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zero_bubble": zero_bubble}[name](p, m, s)


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> float:
    """The idle share of a step the schedule implies, every stage equally fast. Zero bubble with the forward, the
    input gradient and the weight gradient equally long (t each): a 1f1b step waits (p-1) 3t of its
    (m+p-1) 3t; ZB-H1 waits only (p-1) t, the weight gradients filling the rest (Qi et al. 2023)."""
    if name == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if name == "zero_bubble":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)
