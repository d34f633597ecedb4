"""The micro-batch contract, written once for every layout and caller (the trainer, its evaluation and the
self-check): the runner calls it for each action of a schedule, and pp = 1 is a pipeline of one stage.

    forward      inside the micro-batch's dropout coordinates (seed, step, index of its first row in the global
                 batch: layout-invariant dropout hashes its masks from them), the gradient sync's forward context
                 (DDP's no_sync but for the last) and autocast; the labels to every chunk (the loss where the
                 chunk computes it; the tokens its MoE layers' auxiliary losses count everywhere)
    backward     inside the same coordinates and the gradient sync's backward context; the loss divided by the
                 micro-batches (the step's loss is their mean, as one process's) and scaled (the fp16 loss scaler)
                 before its backward, never the gradients after
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..tensor_parallel.rng import dropout_coordinates

INPUT_NAMES = ("tokens", "labels", "document_ids")


def model_inputs(batch: tuple) -> dict:
    """A micro-batch (tokens, labels[, document_ids]) as the model's keyword arguments."""
    return dict(zip(INPUT_NAMES, batch))


def loss_share(scale_loss: Callable, micro_batches: int) -> float:
    """What the backward multiplies a micro-batch's loss by: 1 / the step's micro-batches, then the loss scale
    (`MicroBatchStep.backward`). Auxiliary losses that join the backward (MoE's) are scaled by the same share."""
    return scale_loss(1.0 / micro_batches)


class GradientSync:
    """What a micro-batch's forward and backward run inside, on chunk `chunk`, for the data-parallel reduction;
    `last`: the chunk's last forward, or its last backward that accumulates weight gradients; `finish` completes
    the reduction after the schedule. This one does nothing (one data-parallel rank, evaluation); the trainer's
    variants are in `training.data_parallel`."""

    def forward(self, chunk: int, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, chunk: int, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish(self) -> None:
        pass


class MicroBatchStep:
    """One step's micro-batches on this rank, as the runner's `MicroBatchWork`. `forward_module`: what the forward
    runs through (DDP, or the model); `batches[i]`: micro-batch i on the device; `first_rows[i]`: its first row in
    the step's global batch (default 0: no layout-invariant dropout); `autocast()`: the forward's precision context;
    `scale_loss(loss)`: the loss the backward starts from (the fp16 scaler's)."""

    def __init__(self, forward_module: torch.nn.Module, batches: list[tuple], first_rows: list[int] | None = None,
                 seed: int = 0, step: int = 0, autocast: Callable = contextlib.nullcontext,
                 scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
                 sync: GradientSync | None = None) -> None:
        self.forward_module, self.batches = forward_module, batches
        self.first_rows = first_rows if first_rows is not None else [0] * len(batches)
        self.seed, self.step, self.autocast, self.scale_loss = seed, step, autocast, scale_loss
        self.sync = sync if sync is not None else GradientSync()

    def _coordinates(self, micro: int):
        return dropout_coordinates(self.seed, self.step, self.first_rows[micro])

    def forward(self, micro: int, chunk: int, hidden: torch.Tensor | None, computes_loss: bool,
                last: bool) -> torch.Tensor:
        """The chunk's output: the micro-batch's mean loss where it `computes_loss`, else its activation. Every
        chunk gets the labels: its MoE layers leave the tokens whose label is ignored out of their auxiliary losses."""
        inputs = model_inputs(self.batches[micro])
        with self._coordinates(micro), self.sync.forward(chunk, last), self.autocast():
            return self.forward_module(**inputs, hidden=hidden, chunk=chunk)

    def backward(self, micro: int, chunk: int, output: torch.Tensor, grad: torch.Tensor | None, last: bool) -> None:
        """The backward from `output`: the loss's share of the step (loss / m, scaled), or an activation's with the
        next stage's `grad`."""
        with self._coordinates(micro), self.sync.backward(chunk, last):
            if grad is None:
                self.scale_loss(output / len(self.batches)).backward()
            else:
                torch.autograd.backward(output, grad)
