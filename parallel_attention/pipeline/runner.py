"""Runs one step's schedule on this pipeline rank: each action's forward or backward on its model chunk, and the
sends and receives between neighbouring stages that the action lists imply.

Communication, all through `collectives.exchange` (one batch_isend_irecv per group and direction of a moment):
after each action, the sends it produced go out together with the receive the next action needs (Megatron's
send_forward_recv_backward and friends, derived from the lists instead of written per schedule). The rank waits
for the receive at once and for its sends at the end of the step. Activations travel on the pipeline group,
gradients on its twin (`grad_group`): at pp = 2 both directions join the same two ranks, and NCCL matches messages
by order, not by tag, per communicator.

Shapes are agreed once, before the first step (`agree_shapes`): every stage states what it sends and expects, and
a disagreement raises on every rank, naming both stages, instead of a receive that waits for a message that
never comes.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..tensor_parallel.collectives import all_gather_objects, exchange
from ..tensor_parallel.parallel_state import ProcessGroup, group_rank, group_size
from ..tensor_parallel.weight_grads import deferred_weight_grads, run_weight_grads
from .schedules import Action, build_schedule


class PipelineShapeError(RuntimeError):
    """Two neighbouring stages disagree on the activation they exchange."""


@dataclass
class Event:
    """One span of a rank's step: an action ("F3.1") or a wait for its neighbours ("wait"), in seconds."""

    label: str
    start: float
    end: float


@dataclass
class StepRecord:
    losses: torch.Tensor  # [m]: each micro-batch's mean loss (the last stage's; zeros elsewhere)
    events: list[Event] = field(default_factory=list)
    clock: tuple[float, float] = field(default_factory=lambda: (time.time(), time.perf_counter()))  # wall, perf

    def timeline(self) -> dict:
        """The events as {"start": wall-clock seconds of the step's start, "events": [[label, start, end], ...]}
        in seconds from that start (the stages' files line up by their wall clocks)."""
        wall, perf = self.clock
        return {"start": wall, "events": [[e.label, round(e.start - perf, 6), round(e.end - perf, 6)]
                                          for e in self.events]}

    def compute_seconds(self) -> float:
        """Time this rank spent in its actions (forwards, backwards, weight gradients)."""
        return sum(e.end - e.start for e in self.events if e.label != "wait")

    def span_seconds(self) -> float:
        """From this rank's first wait or action to its last."""
        return self.events[-1].end - self.events[0].start if self.events else 0.0


def measured_bubble(compute_seconds: float, longest_span: float, stages: int) -> float:
    """The share of the step the stages spent not computing: 1 - (compute summed over the stages) / (stages x the
    longest stage's span), the quantity the schedules' formulas predict."""
    return max(0.0, 1.0 - compute_seconds / (stages * longest_span)) if longest_span > 0 else 0.0


class PipelineRunner:
    """This rank's part of the pipeline: the model holding its chunks, the schedule, the groups."""

    def __init__(self, model: torch.nn.Module, schedule: str, micro_batches: int, pp_group: ProcessGroup | None,
                 grad_group: ProcessGroup | None, chunks: int = 1) -> None:
        self.model, self.v, self.m = model, chunks, micro_batches
        self.p, self.rank = group_size(pp_group), group_rank(pp_group)
        self.groups = {"activation": pp_group, "gradient": grad_group}
        self.actions = build_schedule(schedule, self.p, micro_batches, self.rank, chunks)
        self.defers_weight_grads = any(action.kind == "W" for action in self.actions)
        self.shape: tuple | None = None
        self.dtype: torch.dtype | None = None

    # ------------------------------------------------------------------ placement
    def _first(self, chunk: int) -> bool:
        return self.rank == 0 and chunk == 0

    def _last(self, chunk: int) -> bool:
        return self.rank == self.p - 1 and chunk == self.v - 1

    def agree_shapes(self, shape: tuple, dtype: torch.dtype) -> None:
        """Every stage states the activation [s, b, h] (per rank) and dtype it exchanges; all must agree, or every
        rank raises PipelineShapeError naming the stages."""
        said = all_gather_objects((tuple(shape), str(dtype)), self.groups["activation"])
        if len(set(said)) > 1:
            described = "; ".join(f"stage {s}: {list(sh)} {dt}" for s, (sh, dt) in enumerate(said))
            raise PipelineShapeError(f"the pipeline stages disagree on the activation they exchange ({described}): "
                                     "every stage must run the same config (data.seq_len, "
                                     "training.micro_batch_size, model.hidden_size, parallel.*).")
        self.shape, self.dtype = tuple(shape), dtype

    # ------------------------------------------------------------------ the messages an action implies
    def _receive(self, action: Action):
        """(kind, group rank of the peer) of what `action` needs to receive before it runs, or None."""
        if action.kind == "F" and not self._first(action.chunk):
            return "activation", (self.rank - 1) % self.p
        if action.kind == "B" and not self._last(action.chunk):
            return "gradient", (self.rank + 1) % self.p
        return None

    def _send(self, action: Action):
        """(kind, peer, tensor) that `action` produced for a neighbour, or None."""
        key, state = (action.chunk, action.micro), self.state
        if action.kind == "F" and not self._last(action.chunk):
            out = state["outputs"][key] if torch.is_grad_enabled() else state["outputs"].pop(key)
            return "activation", (self.rank + 1) % self.p, out.detach()
        if action.kind == "B" and not self._first(action.chunk):
            return "gradient", (self.rank - 1) % self.p, state["inputs"].pop(key).grad
        return None

    def _communicate(self, send, receive, events: list[Event]) -> torch.Tensor | None:
        """Post the sends and the receive, one exchange per group, then wait for the receive: the sends complete
        when the neighbour posts its receive, which may come only after this rank's next actions (interleaved:
        two ranks that each waited for their own send would wait for each other); `run` waits for them last."""
        posted, received = [], None
        for kind, group in self.groups.items():
            sends = [(t, peer) for k, peer, t in ([send] if send else []) if k == kind]
            for t, _ in sends:
                if tuple(t.shape) != self.shape:
                    raise PipelineShapeError(f"pipeline stage {self.rank} would send its {kind} of shape "
                                             f"{list(t.shape)} where the stages agreed on {list(self.shape)}.")
            receives = []
            if receive is not None and receive[0] == kind:
                received = torch.empty(self.shape, dtype=self.dtype, device=self._device())
                receives = [(received, receive[1])]
            if sends or receives:
                peers = sorted({peer for _, peer in sends + receives})
                what = f"pipeline {kind} exchange of stage {self.rank} with stage {', '.join(map(str, peers))}"
                posted.append(exchange(sends, receives, group, what))
        self._fill_with_weight_gradients(posted, events)
        started = time.perf_counter()
        for pending in posted:
            pending.wait_received()
        self.in_flight += posted
        if posted:
            events.append(Event("wait", started, time.perf_counter()))
        return received

    def _fill_with_weight_gradients(self, posted: list, events: list[Event]) -> None:
        """Zero bubble: while a receive has not arrived, compute the oldest deferred weight gradient instead of
        waiting (the schedule's own W comes later and finds it done). The bubble is filled where it opens."""
        while self.ready_weights and not all(pending.received_yet() for pending in posted):
            key = self.ready_weights.pop(0)
            started = time.perf_counter()
            run_weight_grads(self.state["weights"].pop(key))
            events.append(Event(str(Action("W", *key)), started, time.perf_counter()))

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ the step
    def run(self, inputs: Callable[[int], dict], forward_context: Callable, backward_context: Callable,
            backward_loss: Callable[[torch.Tensor], None] | None = None) -> StepRecord:
        """One step: `inputs(i)` the model's keyword arguments of micro-batch i (tokens, labels, document_ids),
        `forward_context(i)` / `backward_context(i)` what its forward / backward run inside (autocast, dropout
        coordinates), `backward_loss(loss)` runs the backward of the step's share of a loss (loss / m: the fp16
        scaler scales it). Returns each micro-batch's loss (the last stage's) and the step's events."""
        self.contexts, self.in_flight, self.ready_weights = (forward_context, backward_context, backward_loss), [], []
        self.state = {"inputs": {}, "outputs": {}, "weights": {}}  # by (chunk, micro-batch), until their backward
        record = StepRecord(torch.zeros(self.m, device=self._device()))
        received = self._communicate(None, self._receive(self.actions[0]), record.events)
        for k, action in enumerate(self.actions):
            started = time.perf_counter()
            if getattr(self, f"_{action.kind.lower()}")(action, received, inputs, record) is not False:
                record.events.append(Event(str(action), started, time.perf_counter()))
            following = self.actions[k + 1] if k + 1 < len(self.actions) else None
            received = self._communicate(self._send(action),
                                         self._receive(following) if following else None, record.events)
        for pending in self.in_flight:  # the last sends, received by now or soon: nothing is left posted
            pending.wait()
        self.in_flight = []
        return record

    def _f(self, action, received, inputs, record) -> None:
        key, kwargs, state = (action.chunk, action.micro), dict(inputs(action.micro)), self.state
        if not self._last(action.chunk):
            kwargs.pop("labels", None)
        if received is not None:
            state["inputs"][key] = kwargs["hidden"] = received.requires_grad_(torch.is_grad_enabled())
        with self.contexts[0](action.micro):
            out = self.model(**kwargs, chunk=action.chunk)
        if self._last(action.chunk):
            record.losses[action.micro] = out.detach().float()
            out = out / self.m
        state["outputs"][key] = out

    def _b(self, action, received, inputs, record) -> None:
        key = (action.chunk, action.micro)
        out = self.state["outputs"].pop(key)
        deferring = (deferred_weight_grads(self.state["weights"].setdefault(key, [])) if self.defers_weight_grads
                     else contextlib.nullcontext())
        with self.contexts[1](action.micro), deferring:
            if self._last(action.chunk):
                self.contexts[2](out)
            else:
                torch.autograd.backward(out, received)
        if self.defers_weight_grads:
            self.ready_weights.append(key)

    def _w(self, action, received, inputs, record) -> bool:
        """The weight gradient, unless a wait already computed it (then False: nothing ran)."""
        key = (action.chunk, action.micro)
        if key not in self.ready_weights:
            return False
        self.ready_weights.remove(key)
        run_weight_grads(self.state["weights"].pop(key))
        return True
