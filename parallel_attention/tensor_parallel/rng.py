"""Seeding: one seed, identical initialisation on every rank, distinct dropout per TP rank.

`manual_seed(seed)` seeds the default generator (CPU and, where present, CUDA) with the same
value on every rank, so the full weights that each layer builds before keeping its shard are
the same whatever p is. Dropout inside the tensor-parallel region (on attention probabilities,
whose heads differ per rank) must instead differ per rank: it draws from a second generator
state, seeded with `seed + 2718 + tp_rank`, entered with `tensor_parallel_rng()`.

The tensor-parallel state is kept per device type and swapped into the device's default
generator inside the context, so kernels that draw from the default generator (SDPA's fused
dropout on CUDA, for instance) use it without knowing.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

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


def checkpoint_with_tp_rng(function, *args):
    """Activation recomputation (torch.utils.checkpoint) that also replays the tensor-parallel
    generator, so dropout inside the parallel region draws the same masks when recomputed.

    torch.utils.checkpoint already replays the default CPU/CUDA generators.
    """
    from torch.utils.checkpoint import checkpoint

    tp_states_at_forward = get_tensor_parallel_rng_state()
    calls = 0

    def run(*inputs):
        nonlocal calls
        calls += 1
        if calls == 1:
            return function(*inputs)
        current = get_tensor_parallel_rng_state()
        set_tensor_parallel_rng_state(tp_states_at_forward)
        try:
            return function(*inputs)
        finally:
            set_tensor_parallel_rng_state(current)

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)
