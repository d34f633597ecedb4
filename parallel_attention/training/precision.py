"""The precision a run trains in, decided once from `training.dtype` and the device: the same on every device.

    training.dtype   forward                         weights and optimizer   loss scaling
    float32          float32                         float32                 none
    bfloat16         torch.autocast(device, bf16)    float32 (master)        none
    float16          torch.autocast(device, fp16)    float32 (master)        DynamicLossScaler

torch autocasts on CPU as on CUDA (both half dtypes), so a CPU run trains in the precision it was asked for; a
device torch cannot autocast on is refused, never silently run in float32. The run summary's precision line says
what is in effect (`describe`). `training.fp8` is a runtime choice of the layers' linears on top (`fp8_policy`,
entered around each step's schedule and each evaluation): weights, optimizer state and checkpoints keep the
precision above.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..tensor_parallel import parallel_state as ps
from ..tensor_parallel.fp8_all_gather import Fp8WeightGather
from ..tensor_parallel.linear_precision import fp8_linears

HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """`dtype` ('float32', 'bfloat16' or 'float16') on `device`."""

    dtype: str
    device: torch.device

    def __post_init__(self) -> None:
        device_type = torch.device(self.device).type
        if self.dtype in HALF_DTYPES and not torch.amp.is_autocast_available(device_type):
            raise ValueError(f"training.dtype={self.dtype} trains under torch.autocast, which torch "
                             f"{torch.__version__} does not offer on {device_type}: run on cpu or cuda, or set "
                             "--training.dtype=float32.")

    @property
    def loss_scaling(self) -> bool:
        """Whether the dynamic loss scaler is on: float16 only (bf16 has float32's exponent range)."""
        return self.dtype == "float16"

    def autocast(self):
        """The context each forward runs in: autocast to the half dtype, or nothing in float32."""
        if self.dtype not in HALF_DTYPES:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=HALF_DTYPES[self.dtype])

    def describe(self) -> str:
        """The summary's words: what runs in which dtype, and where."""
        if self.dtype not in HALF_DTYPES:
            return f"float32 on {self.device}"
        scaling = ", dynamic loss scaling" if self.loss_scaling else ""
        return f"{self.dtype} autocast, float32 weights{scaling}, on {self.device}"


def fp8_policy(training, device: torch.device, fp8_weights: Fp8WeightGather | None = None):
    """The context a step's schedule and an evaluation run in: the layers' linears in FP8 as `training.fp8` says
    (nothing for none), the amax of token-dependent scales over dp x cp with `training.fp8_global_scales`
    (docs/fp8.md). Around the schedule, so that recomputed forwards and deferred weight gradients are inside.
    `fp8_weights` (zero_stage 3, tensorwise): the weights FSDP2 gathers in e4m3, their scales computed now."""
    group = ps.get_data_context_parallel_group() if training.fp8_global_scales else None
    if fp8_weights is None:
        return fp8_linears(training.fp8, device, group)
    return fp8_linears(training.fp8, device, group, fp8_weights.refresh())


def fp8_weight_gather(model, training, zero_stage: int, shard_group) -> Fp8WeightGather | None:
    """Before FSDP2 shards `model`: its FP8 linears' weights made to all-gather in e4m3, where FSDP2 shards
    (zero_stage 3 over more than one rank, as data_parallel_step does) and FP8 is tensorwise (rowwise quantizes
    each weight twice, per output row and per input column: it gathers in high precision). Else None."""
    if training.fp8 != "tensorwise" or zero_stage != 3 or ps.group_size(shard_group) == 1:
        return None
    return Fp8WeightGather(model, shard_group)
