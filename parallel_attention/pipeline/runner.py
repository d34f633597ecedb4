"""Runs one step's schedule on this pipeline rank: each action's forward or backward on its model chunk, and the
sends and receives between neighbouring stages that the action lists imply.

Communication follows the step's plan (`messages.moments`, which `nccl_model` replays under NCCL's semantics):
between two actions the rank posts what the last one produced and the receive the next one needs, each alone on
its one-way link (`parallel_state.get_pipeline_links`: activations to the next stage, gradients to the previous,
one group of two per ordered pair and direction), through `collectives.exchange`; it waits for the receive, then
for the sends of the moment before, whose buffers go. Nothing of an exchange outlives it: a stage holds what its
schedule keeps for its backwards and one moment's sends, whatever the number of micro-batches.

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

from ..tensor_parallel.collectives import PendingExchange, all_gather_objects, exchange
from ..tensor_parallel.parallel_state import ProcessGroup, group_rank, group_size
from ..tensor_parallel.weight_grads import deferred_weight_grads, run_weight_grads
from .messages import Message, moments
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
    """This rank's part of the pipeline: the model holding its chunks, the schedule, the groups (the pipeline group,
    and the links to its neighbours: `parallel_state.get_pipeline_links()`, None at pp = 1)."""

    def __init__(self, model: torch.nn.Module, schedule: str, micro_batches: int, pp_group: ProcessGroup | None,
                 links: dict[tuple[str, str], ProcessGroup] | None, chunks: int = 1) -> None:
        self.model, self.v, self.m = model, chunks, micro_batches
        self.p, self.rank = group_size(pp_group), group_rank(pp_group)
        self.pp_group, self.links = pp_group, links or {}
        self.actions = build_schedule(schedule, self.p, micro_batches, self.rank, chunks)
        self.plan = moments(self.actions, self.rank, self.p, chunks)
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
        said = all_gather_objects((tuple(shape), str(dtype)), self.pp_group)
        if len(set(said)) > 1:
            described = "; ".join(f"stage {s}: {list(sh)} {dt}" for s, (sh, dt) in enumerate(said))
            raise PipelineShapeError(f"the pipeline stages disagree on the activation they exchange ({described}): "
                                     "every stage must run the same config (data.seq_len, "
                                     "training.micro_batch_size, model.hidden_size, parallel.*).")
        self.shape, self.dtype = tuple(shape), dtype

    # ------------------------------------------------------------------ the messages of the plan
    def _send(self, message: Message) -> torch.Tensor:
        """The tensor `message` carries: a forward's output (kept for its backward while gradients are on) or a
        backward's input gradient (its input goes)."""
        key, state = (message.sent_by // self.p, message.micro), self.state
        if message.link.kind == "activation":
            return (state["outputs"][key] if torch.is_grad_enabled() else state["outputs"].pop(key)).detach()
        return state["inputs"].pop(key).grad

    def _post(self, message: Message) -> PendingExchange:
        """`message` posted alone on its link (a group of two: the peer is the other rank), named by the link."""
        link = message.link
        end = "send" if link.source == self.rank else "receive"
        group = self.links[(link.kind, end)]
        peer = 1 - group_rank(group)
        if end == "receive":
            return exchange([], [(torch.empty(self.shape, dtype=self.dtype, device=self._device()), peer)], group,
                            str(link))
        tensor = self._send(message)
        if tuple(tensor.shape) != self.shape:
            raise PipelineShapeError(f"pipeline stage {self.rank} would send its {link.kind} of shape "
                                     f"{list(tensor.shape)} where the stages agreed on {list(self.shape)}.")
        return exchange([(tensor, peer)], [], group, str(link))

    def _communicate(self, k: int, events: list[Event]) -> torch.Tensor | None:
        """Moment k of the plan (0: before the first action; k: after action k - 1): post its sends and its
        receive, fill the wait for the receive with deferred weight gradients, wait for it, then retire the sends
        the moment names (waited for: their buffers go). Returns the received tensor, or None."""
        moment = self.plan[k]
        posted = {message: self._post(message) for message in moment.posted()}
        self.in_flight.update((message, posted[message]) for message in moment.sends)
        receiving = posted.get(moment.receive)
        self._fill_with_weight_gradients(receiving, events)
        started = time.perf_counter()
        received = receiving.wait()[0] if receiving is not None else None
        for message in moment.retire:
            self.in_flight.pop(message).wait()
        if posted or moment.retire:
            events.append(Event("wait", started, time.perf_counter()))
        return received

    def _fill_with_weight_gradients(self, receiving: PendingExchange | None, events: list[Event]) -> None:
        """Zero bubble: while a receive has not arrived, compute the oldest deferred weight gradient instead of
        waiting (the schedule's own W comes later and finds it done). The bubble is filled where it opens."""
        while self.ready_weights and receiving is not None and not receiving.received_yet():
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
        self.contexts, self.in_flight, self.ready_weights = (forward_context, backward_context, backward_loss), {}, []
        self.state = {"inputs": {}, "outputs": {}, "weights": {}}  # by (chunk, micro-batch), until their backward
        record = StepRecord(torch.zeros(self.m, device=self._device()))
        received = self._communicate(0, record.events)
        for k, action in enumerate(self.actions):
            started = time.perf_counter()
            if getattr(self, f"_{action.kind.lower()}")(action, received, inputs, record) is not False:
                record.events.append(Event(str(action), started, time.perf_counter()))
            received = self._communicate(k + 1, record.events)  # the last moment retires every send left
        return record

    def _f(self, action, received, inputs, record) -> None:
        key, kwargs, state = (action.chunk, action.micro), dict(inputs(action.micro)), self.state
        if not self._last(action.chunk):
            kwargs.pop("labels", None)
        if received is not None:
            kwargs["hidden"] = received.requires_grad_(torch.is_grad_enabled())
            if torch.is_grad_enabled():  # kept for its backward's input gradient (evaluation lets it go)
                state["inputs"][key] = received
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
