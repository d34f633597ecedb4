"""Counter-based dropout masks: each element's keep bit is a hash of its global coordinates.

An element is kept when `mix64(key + index * GAMMA)`, read as a signed 64-bit integer, is at least
`keep_threshold(p)` (so with probability 1 - p, to 2**-64), where `key` names the stream (seed, step,
layer, site: `stream_key`), `index` is the element's row-major index in the *global* tensor (every
sample of the step, every head, the whole sequence, every channel) and `mix64` is splitmix64's
finaliser without its last xorshift (that step changes only the low 33 bits, which decide the
comparison with probability 2**-31: not worth three passes over the mask). A rank computes only the slice it holds, so the mask of an element does not depend on p,
sequence parallelism, data parallelism, micro-batching or the device: the same coordinates give the
same bit everywhere (int64 arithmetic wraps alike on CPU and CUDA).

Each axis of the local tensor is described by `(start, count, stride)`: this rank holds global
indices start .. start+count-1 along it, and `stride` is the axis' stride in the global row-major
layout. For attention probabilities [b, nh/p, s, s] of a step with nh heads:
`[(first_sample, b, nh*s*s), (head0, nh/p, s*s), (0, s, s), (0, s, 1)]`. Adjacent axes that are
contiguous in the global layout are merged first: the cost is a few small aranges, one int64 add
and ten elementwise int64 operations on the mask's size.

The hashes are computed in blocks along the longest axis but the last (the query rows of attention probabilities,
the positions of [b, s, h] activations), each block written into the boolean mask: a block's sub-range of an axis is
itself an axis description, so each element hashes exactly as in one pass, while the int64 work tensors hold at most
`BLOCK_ELEMENTS` elements (or one row of that axis) instead of the mask's size: at [1, 1, 4096, 4096] the peak is
the boolean mask and a block, 24 MiB against one pass's 512 (four int64 tensors of the mask's size at once). Under
torch.compile one pass is traced: the compiler fuses the elementwise chain into one kernel that writes the booleans.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (2**64 / golden ratio, odd)
_MUL1, _MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix64(z: int) -> int:
    """splitmix64's finaliser on Python ints (the reference the tensor version matches)."""
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def stream_key(*words: int) -> int:
    """One 64-bit key from integer coordinates (seed, step, layer, site), each word mixed in turn."""
    key = 0
    for word in words:
        key = _mix64((key + (word & _MASK64) + _GAMMA) & _MASK64)
    return key


def stream_key_tensor(key: torch.Tensor, *words: torch.Tensor | int) -> torch.Tensor:
    """stream_key continued from `key` (an int64 0-d tensor holding a key's bits) over more words, in int64 tensor
    arithmetic (it wraps as the Python version masks): stream_key_tensor(tensor(stream_key(a, b)), c, d) holds the
    bits of stream_key(a, b, c, d). Under torch.compile a tensor word is an input, not a constant: a layer index
    given as a tensor costs no guard, so one compilation serves every layer."""
    for word in words:
        key = _mix64_tensor(key + word + _signed(_GAMMA))
    return key


def _mix64_tensor(z: torch.Tensor) -> torch.Tensor:
    z = z ^ _shift_right(z, 30)
    z = z * _signed(_MUL1)
    z = z ^ _shift_right(z, 27)
    z = z * _signed(_MUL2)
    return z ^ _shift_right(z, 31)


def as_key(value: int) -> torch.Tensor:
    """A 64-bit key or word as the int64 0-d CPU tensor with the same bits (usable with tensors of any device)."""
    return torch.tensor(_signed(value), dtype=torch.int64)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> on int64 is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def keep_threshold(p: float) -> int:
    """An element is kept when its signed 64-bit hash is >= this: keep rate 1 - p (to 2**-64)."""
    return -(1 << 63) + min(round(p * 2.0**64), (1 << 64) - 1)


def _key_bits(key: int | torch.Tensor) -> int | torch.Tensor:
    return key if isinstance(key, torch.Tensor) else _signed(key)


def _merged(axes: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge each axis into the one before it when the pair is one contiguous run of global indices."""
    merged = [tuple(axes[0])]
    for start, count, stride in axes[1:]:
        prev_start, prev_count, prev_stride = merged[-1]
        if start == 0 and prev_stride == count * stride:
            merged[-1] = (prev_start * count, prev_count * count, stride)
        else:
            merged.append((start, count, stride))
    return merged


BLOCK_ELEMENTS = 1 << 18  # int64 work tensors of at most 2 MiB each


def keep_mask(p: float, key: int | torch.Tensor, axes: Sequence[tuple[int, int, int]], device) -> torch.Tensor:
    """Boolean keep mask of shape [count for each axis]: True with probability 1 - p, a pure function
    of (key, global index) of each element (see the module docstring for `axes`), hashed in blocks. `key`: an int
    or an int64 0-d tensor of its bits (`as_key`, `stream_key_tensor`); the first axis' start may be an int64 0-d
    tensor too (a micro-batch's first sample, read by torch.compile as an input)."""
    shape = [count for _, count, _ in axes]
    if torch.compiler.is_compiling() or len(axes) < 2:
        return _keep_mask_in_one_pass(p, key, axes, device)
    dim = max(range(len(axes) - 1), key=lambda d: shape[d])  # the first longest axis but the last
    rows = max(1, BLOCK_ELEMENTS * shape[dim] // max(1, math.prod(shape)))
    if rows >= shape[dim]:
        return _keep_mask_in_one_pass(p, key, axes, device)
    mask = torch.empty(shape, dtype=torch.bool, device=device)
    start, _, stride = axes[dim]
    for first in range(0, shape[dim], rows):
        count = min(rows, shape[dim] - first)
        block = [*axes[:dim], (start + first, count, stride), *axes[dim + 1:]]
        mask.narrow(dim, first, count).copy_(_keep_mask_in_one_pass(p, key, block, device))
    return mask


def _keep_mask_in_one_pass(p: float, key: int, axes: Sequence[tuple[int, int, int]], device) -> torch.Tensor:
    merged = _merged(axes)
    state = None
    for dim, (start, count, stride) in enumerate(merged):
        term = (torch.arange(count, dtype=torch.int64, device=device) + start) * _signed(stride * _GAMMA)
        term = term.view([count if d == dim else 1 for d in range(len(merged))])
        state = term + _key_bits(key) if state is None else state + term  # int64 wraps mod 2**64
    state = state.reshape([count for _, count, _ in axes])
    state ^= _shift_right(state, 30)
    state *= _signed(_MUL1)
    state ^= _shift_right(state, 27)
    state *= _signed(_MUL2)
    return state >= keep_threshold(p)
