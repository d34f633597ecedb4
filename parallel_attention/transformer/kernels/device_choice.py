"""Modules whose implementation depends on the device of their tensors: chosen at construction and again when the
module moves (`.to`, `.cuda`, `to_empty`), never per call."""

from __future__ import annotations

import torch
from torch import nn


class ChosenByDevice(nn.Module):
    """Holds where the module lives (`self.device`) and calls the subclass's `_choose()` whenever that changes;
    the subclass calls `_choose()` once at the end of its own __init__."""

    def __init__(self, device=None) -> None:
        super().__init__()
        self._where = torch.empty(0, device=device)  # a plain attribute, not a buffer: no state, nothing to sync

    @property
    def device(self) -> torch.device:
        return self._where.device

    def _choose(self) -> None:
        raise NotImplementedError

    def _apply(self, fn, recurse: bool = True):
        self._where = fn(self._where)
        self._choose()
        return super()._apply(fn, recurse)
