"""Seeding: one seed, identical initialisation on every rank, distinct dropout per TP rank.

`manual_seed(seed)` seeds the default generator (CPU and, where present, CUDA) with the same
value on every rank, so the full weights that each layer builds before keeping its shard are
the same whatever p is. Dropout inside the tensor-parallel region (on attention probabilities,
whose heads differ per rank) must instead differ per rank: it draws from a second generator
state, seeded with `seed + 2718 + tp_rank`, entered with `tensor_parallel_rng()`.

The tensor-parallel state is kept per device type and swapped into the device's default
generator inside the context, so kernels that draw from the default generator (SDPA's fused
dropout on CUDA, for instance) use it without knowing.

Layout-invariant dropout (`model.dropout_rng: layout_invariant`) draws no generator at all: its
masks hash (seed, step, global sample, layer, site, head or channel, position) (`dropout_hash`).
The trainer says where each micro-batch sits by entering `dropout_coordinates(seed, step,
first_sample)` around its forward and backward; the layers read them with
`current_dropout_coordinates()`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from . import dropout_hash
from .parallel_state import ProcessGroup, group_rank, resolve_tp_group

_TP_SEED_OFFSET = 2718
_tp_states: dict[str, torch.Tensor] = {}


def _get_state(device_type: str) -> torch.Tensor:
    if device_type == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _device_types() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def manual_seed(seed: int, tp_group: ProcessGroup | None = None) -> None:
    """Seed the default generators identically and the tensor-parallel generators per TP rank."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative integer.")
    tp_rank = group_rank(resolve_tp_group(tp_group))
    tp_seed = seed + _TP_SEED_OFFSET + tp_rank
    for device_type in _device_types():
        torch.manual_seed(tp_seed)  # seeds CPU and every CUDA device
        _tp_states[device_type] = _get_state(device_type)
    torch.manual_seed(seed)


def _ensure_state(device_type: str) -> None:
    if device_type not in _tp_states:
        raise RuntimeError(
            "dropout inside the tensor-parallel region needs parallel_attention.manual_seed(seed) "
            "to be called first (it seeds a separate generator per tensor-parallel rank)."
        )


@contextlib.contextmanager
def tensor_parallel_rng(device: torch.device | str) -> Iterator[None]:
    """Draw from the tensor-parallel generator of `device`'s type inside this block."""
    device_type = torch.device(device).type
    _ensure_state(device_type)
    saved = _get_state(device_type)
    _set_state(device_type, _tp_states[device_type])
    try:
        yield
    finally:
        _tp_states[device_type] = _get_state(device_type)
        _set_state(device_type, saved)


def get_tensor_parallel_rng_state() -> dict[str, torch.Tensor]:
    """A copy of the tensor-parallel generator states (for checkpoints and recomputation)."""
    return {k: v.clone() for k, v in _tp_states.items()}


def set_tensor_parallel_rng_state(states: dict[str, torch.Tensor]) -> None:
    _tp_states.clear()
    _tp_states.update({k: v.clone() for k, v in states.items()})


@dataclass(frozen=True)
class DropoutCoordinates:
    """Where the running micro-batch sits: the coordinates layout-invariant dropout hashes. `stream` (the key of
    (seed, step)) and `first_sample_tensor` hold the same as int64 0-d CPU tensors: read under torch.compile they are
    inputs, not constants, so a new step or micro-batch compiles nothing again."""

    seed: int
    step: int
    first_sample: int  # index, in the step's global batch, of the micro-batch's first row
    stream: torch.Tensor = field(init=False, repr=False, compare=False)
    first_sample_tensor: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stream", dropout_hash.as_key(dropout_hash.stream_key(self.seed, self.step)))
        object.__setattr__(self, "first_sample_tensor", dropout_hash.as_key(self.first_sample))

    def keep_mask(self, p: float, layer: int | torch.Tensor, site: int, axes: Sequence[tuple[int, int, int]],
                  device) -> torch.Tensor:
        """Keep mask of one dropout site (see dropout_hash.keep_mask for `axes`; the samples' axis starts at
        `first_sample_tensor`). `layer` as a tensor (`dropout_hash.as_key`) costs torch.compile no guard."""
        key = dropout_hash.stream_key_tensor(self.stream, layer, site)  # = stream_key(seed, step, layer, site)
        return dropout_hash.keep_mask(p, key, axes, device)


_coordinates: DropoutCoordinates | None = None


@contextlib.contextmanager
def dropout_coordinates(seed: int, step: int, first_sample: int) -> Iterator[DropoutCoordinates]:
    """Inside this block, layout-invariant dropout draws the masks of (seed, step) for the micro-batch
    whose first row is sample `first_sample` of the step's global batch. Wrap forward and backward."""
    global _coordinates
    saved, _coordinates = _coordinates, DropoutCoordinates(seed, step, first_sample)
    try:
        yield _coordinates
    finally:
        _coordinates = saved


def current_dropout_coordinates() -> DropoutCoordinates:
    if _coordinates is None:
        raise RuntimeError(
            "model.dropout_rng='layout_invariant' draws each dropout mask from (seed, step, sample): run the "
            "training forward and backward inside parallel_attention.tensor_parallel.rng."
            "dropout_coordinates(seed, step, first_sample) (the trainer does), or use dropout_rng='per_rank'.")
    return _coordinates


def checkpoint_with_tp_rng(function, *args):
    """Activation recomputation (torch.utils.checkpoint) that also replays the tensor-parallel
    generator and the dropout coordinates, so dropout draws the same masks when recomputed.

    torch.utils.checkpoint already replays the default CPU/CUDA generators.
    """
    from torch.utils.checkpoint import checkpoint

    tp_states_at_forward, coordinates_at_forward = get_tensor_parallel_rng_state(), _coordinates
    calls = 0

    def run(*inputs):
        global _coordinates
        nonlocal calls
        calls += 1
        if calls == 1:
            return function(*inputs)
        current, current_coordinates = get_tensor_parallel_rng_state(), _coordinates
        set_tensor_parallel_rng_state(tp_states_at_forward)
        _coordinates = coordinates_at_forward
        try:
            return function(*inputs)
        finally:
            set_tensor_parallel_rng_state(current)
            _coordinates = current_coordinates

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)
