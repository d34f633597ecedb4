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
from typing import Protocol

import torch

from ..tensor_parallel.collectives import all_gather_objects, exchange
from ..tensor_parallel.parallel_state import ProcessGroup, group_rank, group_size
from ..tensor_parallel.weight_grads import deferred_weight_grads, run_weight_grads
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
    """This rank's part of the pipeline: the model holding its chunks, the schedule, the groups. At pp = 1 it is a
    pipeline of one stage: 1f1b runs F0 B0 F1 B1 ..., and nothing is sent."""

    def __init__(self, model: torch.nn.Module, schedule: str, micro_batches: int, pp_group: ProcessGroup | None,
                 grad_group: ProcessGroup | None, chunks: int = 1) -> None:
        self.model, self.v, self.m = model, chunks, micro_batches
        self.p, self.rank = group_size(pp_group), group_rank(pp_group)
        self.groups = {"activation": pp_group, "gradient": grad_group}
        self.actions = build_schedule(schedule, self.p, micro_batches, self.rank, chunks)
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
        said = all_gather_objects((shapes, str(dtype)), self.groups["activation"])
        if any(other != said[0] for other in said):
            described = "; ".join(f"stage {s}: {_describe(sh)} {dt}" for s, (sh, dt) in enumerate(said))
            raise PipelineShapeError(f"the pipeline stages disagree on the activation they exchange ({described}): "
                                     "every stage must run the same config (data.seq_len, "
                                     "training.micro_batch_size, model.hidden_size, parallel.*).")
        self.shapes, self.dtype = shapes, dtype

    # ------------------------------------------------------------------ the messages an action implies
    def _receive(self, action: Action):
        """(kind, group rank of the peer, micro-batch) of what `action` needs to receive before it runs, or None."""
        if action.kind == "F" and not self._first(action.chunk):
            return "activation", (self.rank - 1) % self.p, action.micro
        if action.kind == "B" and not self._last(action.chunk):
            return "gradient", (self.rank + 1) % self.p, action.micro
        return None

    def _send(self, action: Action):
        """(kind, peer, tensor, micro-batch) that `action` produced for a neighbour, or None."""
        key, state = (action.chunk, action.micro), self.state
        if action.kind == "F" and not self._last(action.chunk):
            out = state["outputs"][key] if torch.is_grad_enabled() else state["outputs"].pop(key)
            return "activation", (self.rank + 1) % self.p, out.detach(), action.micro
        if action.kind == "B" and not self._first(action.chunk):
            return "gradient", (self.rank - 1) % self.p, state["inputs"].pop(key).grad, action.micro
        return None

    def _communicate(self, send, receive, record: StepRecord) -> torch.Tensor | None:
        """Post the sends and the receive, one exchange per group, then wait for the receive: the sends complete
        when the neighbour posts its receive, which may come only after this rank's next actions (interleaved:
        two ranks that each waited for their own send would wait for each other); `run` waits for them last."""
        posted, received = [], None
        for kind, group in self.groups.items():
            sends = [(t, peer) for k, peer, t, micro in ([send] if send else []) if k == kind]
            for (t, _), expected in zip(sends, [self.shapes[send[3]]] if sends else []):
                if tuple(t.shape) != expected:
                    raise PipelineShapeError(f"pipeline stage {self.rank} would send its {kind} of shape "
                                             f"{list(t.shape)} where the stages agreed on {list(expected)}.")
            receives = []
            if receive is not None and receive[0] == kind:
                received = torch.empty(self.shapes[receive[2]], dtype=self.dtype, device=self._device())
                receives = [(received, receive[1])]
            if sends or receives:
                peers = sorted({peer for _, peer in sends + receives})
                what = f"pipeline {kind} exchange of stage {self.rank} with stage {', '.join(map(str, peers))}"
                posted.append(exchange(sends, receives, group, what))
        self._fill_with_weight_gradients(posted, record)
        started = record.clock.mark()
        for pending in posted:
            pending.wait_received()
        self.in_flight += posted
        if posted:
            record.span("wait", started)
        return received

    def _fill_with_weight_gradients(self, posted: list, record: StepRecord) -> None:
        """Zero bubble: while a receive has not arrived, compute the oldest deferred weight gradient instead of
        waiting (the schedule's own W comes later and finds it done). The bubble is filled where it opens."""
        while self.ready_weights and not all(pending.received_yet() for pending in posted):
            key = self.ready_weights.pop(0)
            started = record.clock.mark()
            run_weight_grads(self.state["weights"].pop(key))
            record.span(str(Action("W", *key)), started)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ the step
    def run(self, work: MicroBatchWork) -> StepRecord:
        """One step: each action through `work` (forward, backward) or the deferred weight gradients, with the
        messages the actions imply. Returns each micro-batch's loss (the last stage's) and the step's events."""
        self.work, self.in_flight, self.ready_weights = work, [], []
        self.state = {"inputs": {}, "outputs": {}, "weights": {}}  # by (chunk, micro-batch), until their backward
        device = self._device()
        record = StepRecord(torch.zeros(self.m, device=device), clock_for(device))
        received = self._communicate(None, self._receive(self.actions[0]), record)
        for k, action in enumerate(self.actions):
            started = record.clock.mark()
            if self.run_action[action.kind](action, received, record) is not False:
                record.span(str(action), started)
            following = self.actions[k + 1] if k + 1 < len(self.actions) else None
            received = self._communicate(self._send(action), self._receive(following) if following else None,
                                         record)
        for pending in self.in_flight:  # the last sends, received by now or soon: nothing is left posted
            pending.wait()
        self.in_flight = []
        return record

    def _forward(self, action: Action, received: torch.Tensor | None, record: StepRecord) -> None:
        key, state, computes_loss = (action.chunk, action.micro), self.state, self._last(action.chunk)
        if received is not None:
            state["inputs"][key] = received.requires_grad_(torch.is_grad_enabled())
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
