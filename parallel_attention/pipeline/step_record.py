"""What one step of a stage did and when: each micro-batch's loss, and the spans of its actions and waits.

Where the device runs asynchronously to the host (CUDA), a span's ends are device events recorded on the current
stream, read once when the record is read (after the step): host clocks around an action there measure only the
time to enqueue it. On CPU the host clock is the device's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class HostClock:
    """Marks are host perf_counter readings, in seconds."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        return end - start


class DeviceClock:
    """Marks are timing events on the device's current stream; `seconds` waits for the later one (one sync when
    a record is read, none while the step runs)."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


def clock_for(device: torch.device) -> HostClock | DeviceClock:
    """The clock that times work on `device`: its events where it runs asynchronously (CUDA), else the host's."""
    return DeviceClock() if device.type == "cuda" else HostClock()


@dataclass
class Event:
    """One span of a rank's step: an action ("F3.1") or a wait for its neighbours ("wait"), between two marks of
    the step's clock."""

    label: str
    start: object
    end: object


@dataclass
class StepRecord:
    losses: torch.Tensor  # [m]: each micro-batch's mean loss (the last stage's; zeros elsewhere)
    clock: HostClock | DeviceClock = field(default_factory=HostClock)
    events: list[Event] = field(default_factory=list)
    started: tuple = field(init=False)  # (wall-clock seconds, the clock's mark) at the step's start

    def __post_init__(self) -> None:
        self.started = (time.time(), self.clock.mark())

    def span(self, label: str, start) -> None:
        """Record `label` from the mark `start` to now."""
        self.events.append(Event(label, start, self.clock.mark()))

    def timeline(self) -> dict:
        """The events as {"start": wall-clock seconds of the step's start, "events": [[label, start, end], ...]}
        in seconds from that start (the stages' files line up by their wall clocks)."""
        wall, origin = self.started
        since = lambda mark: round(self.clock.seconds(origin, mark), 6)  # noqa: E731
        return {"start": wall, "events": [[e.label, since(e.start), since(e.end)] for e in self.events]}

    def compute_seconds(self) -> float:
        """Time this rank spent in its actions (forwards, backwards, weight gradients)."""
        return sum(self.clock.seconds(e.start, e.end) for e in self.events if e.label != "wait")

    def span_seconds(self) -> float:
        """From this rank's first wait or action to its last."""
        return self.clock.seconds(self.events[0].start, self.events[-1].end) if self.events else 0.0


def measured_bubble(compute_seconds: float, longest_span: float, stages: int) -> float:
    """The share of the step the stages spent not computing: 1 - (compute summed over the stages) / (stages x the
    longest stage's span), the quantity the schedules' formulas predict."""
    return max(0.0, 1.0 - compute_seconds / (stages * longest_span)) if longest_span > 0 else 0.0
