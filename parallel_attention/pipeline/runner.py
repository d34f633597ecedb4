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
from typing import Protocol

import torch

from ..tensor_parallel.collectives import PendingExchange, all_gather_objects, exchange
from ..tensor_parallel.parallel_state import ProcessGroup, group_rank, group_size
from ..tensor_parallel.weight_grads import deferred_weight_grads, run_weight_grads
from .messages import Message, moments
from .schedules import Action, build_schedule
from .step_record import StepRecord, clock_for


class PipelineShapeError(RuntimeError):
    """Two neighbouring stages disagree on the activation they exchange."""


class MicroBatchWork(Protocol):
    """What the runner asks of the step: one micro-batch's forward and backward on one chunk (the micro-batch
    contract: inputs, dropout coordinates, autocast, loss / m, the scaled backward, when gradients synchronise).
    `last`: this is the chunk's last forward (its backward is the step's last) / the chunk's last backward that
    accumulates weight gradients (False for every B of a schedule that defers them to W)."""

    def forward(self, micro: int, chunk: int, hidden: torch.Tensor | None, computes_loss: bool,
                last: bool) -> torch.Tensor: ...

    def backward(self, micro: int, chunk: int, output: torch.Tensor, grad: torch.Tensor | None,
                 last: bool) -> None: ...


class PipelineRunner:
    """This rank's part of the pipeline: the model holding its chunks, the schedule, the groups (the pipeline group,
    and the links to its neighbours: `parallel_state.get_pipeline_links()`, None at pp = 1). At pp = 1 it is a
    pipeline of one stage: 1f1b runs F0 B0 F1 B1 ..., and nothing is sent."""

    def __init__(self, model: torch.nn.Module, schedule: str, micro_batches: int, pp_group: ProcessGroup | None,
                 links: dict[tuple[str, str], ProcessGroup] | None, chunks: int = 1) -> None:
        self.model, self.v, self.m = model, chunks, micro_batches
        self.p, self.rank = group_size(pp_group), group_rank(pp_group)
        self.pp_group, self.links = pp_group, links or {}
        self.actions = build_schedule(schedule, self.p, micro_batches, self.rank, chunks)
        self.plan = moments(self.actions, self.rank, self.p, chunks)
        self.defers_weight_grads = any(action.kind == "W" for action in self.actions)
        self.last_actions = _last_of_each_chunk(self.actions, self.defers_weight_grads)
        self.run_action = {"F": self._forward, "B": self._backward, "W": self._weight_gradient}
        self.shapes: list[tuple] | None = None
        self.dtype: torch.dtype | None = None

    # ------------------------------------------------------------------ placement
    def _first(self, chunk: int) -> bool:
        return self.rank == 0 and chunk == 0

    def _last(self, chunk: int) -> bool:
        return self.rank == self.p - 1 and chunk == self.v - 1

    def agree_shapes(self, shapes: tuple | list[tuple], dtype: torch.dtype) -> None:
        """Every stage states the activation [s, b, h] (per rank; one shape for every micro-batch, or a list of
        one per micro-batch) and dtype it exchanges; all must agree, or every rank raises PipelineShapeError
        naming the stages."""
        shapes = [tuple(shapes)] * self.m if isinstance(shapes[0], int) else [tuple(s) for s in shapes]
        said = all_gather_objects((shapes, str(dtype)), self.pp_group)
        if any(other != said[0] for other in said):
            described = "; ".join(f"stage {s}: {_describe(sh)} {dt}" for s, (sh, dt) in enumerate(said))
            raise PipelineShapeError(f"the pipeline stages disagree on the activation they exchange ({described}): "
                                     "every stage must run the same config (data.seq_len, "
                                     "training.micro_batch_size, model.hidden_size, parallel.*).")
        self.shapes, self.dtype = shapes, dtype

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
        link, expected = message.link, self.shapes[message.micro]
        end = "send" if link.source == self.rank else "receive"
        group = self.links[(link.kind, end)]
        peer = 1 - group_rank(group)
        if end == "receive":
            return exchange([], [(torch.empty(expected, dtype=self.dtype, device=self.device), peer)], group,
                            str(link))
        tensor = self._send(message)
        if tuple(tensor.shape) != expected:
            raise PipelineShapeError(f"pipeline stage {self.rank} would send its {link.kind} of shape "
                                     f"{list(tensor.shape)} where the stages agreed on {list(expected)}.")
        return exchange([(tensor, peer)], [], group, str(link))

    def _communicate(self, k: int, record: StepRecord) -> torch.Tensor | None:
        """Moment k of the plan (0: before the first action; k: after action k - 1): post its sends and its
        receive, fill the wait for the receive with deferred weight gradients, wait for it, then retire the sends
        the moment names (waited for: their buffers go). Returns the received tensor, or None."""
        moment = self.plan[k]
        posted = {message: self._post(message) for message in moment.posted()}
        self.in_flight.update((message, posted[message]) for message in moment.sends)
        receiving = posted.get(moment.receive)
        self._fill_with_weight_gradients(receiving, record)
        started = record.clock.mark()
        received = receiving.wait()[0] if receiving is not None else None
        for message in moment.retire:
            self.in_flight.pop(message).wait()
        if posted or moment.retire:
            record.span("wait", started)
        return received

    def _fill_with_weight_gradients(self, receiving: PendingExchange | None, record: StepRecord) -> None:
        """Zero bubble: while a receive has not arrived, compute the oldest deferred weight gradient instead of
        waiting (the schedule's own W comes later and finds it done). The bubble is filled where it opens."""
        while self.ready_weights and receiving is not None and not receiving.received_yet():
            key = self.ready_weights.pop(0)
            started = record.clock.mark()
            run_weight_grads(self.state["weights"].pop(key))
            record.span(str(Action("W", *key)), started)

    # ------------------------------------------------------------------ the step
    def run(self, work: MicroBatchWork) -> StepRecord:
        """One step: each action through `work` (forward, backward) or the deferred weight gradients, with the
        messages the actions imply. Returns each micro-batch's loss (the last stage's) and the step's events."""
        self.work, self.in_flight, self.ready_weights = work, {}, []
        self.state = {"inputs": {}, "outputs": {}, "weights": {}}  # by (chunk, micro-batch), until their backward
        self.device = next(self.model.parameters()).device  # where the receives land (read once a step)
        record = StepRecord(torch.zeros(self.m, device=self.device), clock_for(self.device))
        received = self._communicate(0, record)
        for k, action in enumerate(self.actions):
            started = record.clock.mark()
            if self.run_action[action.kind](action, received, record) is not False:
                record.span(str(action), started)
            received = self._communicate(k + 1, record)  # the last moment retires every send left
        return record

    def _forward(self, action: Action, received: torch.Tensor | None, record: StepRecord) -> None:
        key, state, computes_loss = (action.chunk, action.micro), self.state, self._last(action.chunk)
        if received is not None and torch.is_grad_enabled():  # kept for its backward (evaluation lets it go)
            state["inputs"][key] = received.requires_grad_()
        out = self.work.forward(action.micro, action.chunk, received, computes_loss, action in self.last_actions)
        if computes_loss:
            record.losses[action.micro] = out.detach().float()
        state["outputs"][key] = out

    def _backward(self, action: Action, received: torch.Tensor | None, record: StepRecord) -> None:
        key = (action.chunk, action.micro)
        out = self.state["outputs"].pop(key)
        deferring = (deferred_weight_grads(self.state["weights"].setdefault(key, [])) if self.defers_weight_grads
                     else contextlib.nullcontext())
        with deferring:
            self.work.backward(action.micro, action.chunk, out, None if self._last(action.chunk) else received,
                               action in self.last_actions)
        if self.defers_weight_grads:
            self.ready_weights.append(key)

    def _weight_gradient(self, action: Action, received: torch.Tensor | None, record: StepRecord) -> bool:
        """The weight gradient, unless a wait already computed it (then False: nothing ran)."""
        key = (action.chunk, action.micro)
        if key not in self.ready_weights:
            return False
        self.ready_weights.remove(key)
        run_weight_grads(self.state["weights"].pop(key))
        return True


def _last_of_each_chunk(actions: list[Action], defers_weight_grads: bool) -> set[Action]:
    """Each chunk's last forward and, unless weight gradients are deferred to W, its last backward: where a
    data-parallel reduction of that chunk's gradients may start."""
    last = {}
    for action in actions:
        if action.kind == "F" or (action.kind == "B" and not defers_weight_grads):
            last[(action.kind, action.chunk)] = action
    return set(last.values())


def _describe(shapes: list[tuple]) -> str:
    distinct = sorted(set(shapes))
    return str(list(distinct[0])) if len(distinct) == 1 else "per micro-batch " + str([list(s) for s in shapes])
