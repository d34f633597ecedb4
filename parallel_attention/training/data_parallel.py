"""Data-parallel gradient reduction: torch's DistributedDataParallel over the data-parallel group.

    micro-batch 1 .. n-1   forward + backward under no_sync(): gradients accumulate locally, no collective
    micro-batch n          forward + backward: each bucket (~bucket_cap_mb, parameters in reverse order of
                           registration) is all-reduced and averaged over the dp ranks from the autograd hooks
                           as soon as its last gradient is ready, overlapping the rest of the backward

The step engine asks a `GradientSync` (`data_parallel_step`) what each micro-batch's forward and backward run
inside: DDP's `no_sync` until the last micro-batch, FSDP2's `set_requires_gradient_sync`, or, in a pipeline, where
several forwards are in flight before their backwards (which DDP's reducer cannot follow), `ChunkReducer`.

Under `parallel.debug_collectives` the model is wrapped in `ReducedAfterBackward` instead: the same average,
in flat buckets after the last micro-batch's backward, through `collectives`, where the guard records and
cross-checks it (DDP's C++ reducer bypasses the guard, and torch 2.13's DDP crashes on the gloo groups that
TORCH_DISTRIBUTED_DEBUG=DETAIL wraps). Slower, never overlapped: a debugging path.

Experts split over an expert-parallel group (MoE at ep > 1, `param_kinds.ExpertShard`) differ between the dp
ranks: DDP leaves them out (its documented ignore list) and `finalize_grads` averages them over the ranks that
hold the same experts; FSDP2 shards them over those ranks (`fsdp.shard_split_experts`).

DDP shares the model's parameters: everything but the training forward (checkpoints, the global norm, the
replica audit, evaluation) keeps using the raw model. The average runs over the data-parallel group only;
`finalize_grads` sums partial gradients over the tensor-parallel group afterwards, and the two commute (both
are linear, over disjoint groups). At dp = 1 there is no wrapper and no collective. DDP's hooks and its
one-off parameter check and broadcast at construction are torch's own documented engine, not hidden
collectives of this package (docs/architecture.md, "House rules and why").
"""

from __future__ import annotations

import contextlib
import inspect

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..pipeline.micro_batch_step import GradientSync
from ..tensor_parallel.collectives import named_timeouts
from ..tensor_parallel.expert_shards import split_experts
from ..tensor_parallel.parallel_state import ProcessGroup, group_size
from ..transformer.pipeline_stage import chunk_parameters
from .chunk_reducer import ChunkReducer
from .fsdp import gradient_sync, mesh_of, shard_fully
from .gradients import all_reduce_data_parallel

BUCKET_CAP_MB = 25  # DDP's default: small enough that the first buckets start early in the backward
# parameters are the same on every dp rank and buffers are never trained: no buffer broadcast per forward
# (torch >= 2.13 spells it forward_sync_buffers; broadcast_buffers is the older, deprecated name)
_NO_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                   inspect.signature(DistributedDataParallel.__init__).parameters else {"broadcast_buffers": False})


def wrap_data_parallel(model: nn.Module, group: ProcessGroup | None, debug_collectives: bool = False,
                       bucket_cap_mb: float = BUCKET_CAP_MB, zero_stage: int = 0) -> nn.Module:
    """What the training forward runs through: DDP over `group` when it has more than one rank (ReducedAfterBackward
    under debug_collectives), else `model`. zero_stage 3: `model` itself, sharded by FSDP2 over a 1-D mesh of
    `group` (the trainer's: dp x cp, `fsdp.mesh_of`); build the optimizer after this call, over the sharded
    parameters.

    gradient_as_bucket_view: the gradients are views into DDP's buckets (no copy in and out of them), which
    clipping and the optimizer read and scale in place like any gradient.
    """
    return data_parallel_step(model, group, debug_collectives, zero_stage, pipelined=False,
                              bucket_cap_mb=bucket_cap_mb)[0]


class ReducedAfterBackward(nn.Module):
    """The data-parallel average after the backward of a step's last micro-batch, through `collectives`."""

    def __init__(self, module: nn.Module, group: ProcessGroup | None, left_out: set[str] = frozenset()) -> None:
        super().__init__()
        self.module, self.group = module, group
        self.params = [p for name, p in module.named_parameters() if name not in left_out]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def sync(self):
        yield
        all_reduce_data_parallel(self.params, self.group)


class DDPSync(GradientSync):
    """DDP: forwards under no_sync() but the last, whose backward reduces from DDP's hooks (DDP reads the flag in
    the forward). Its reducer's timeouts name the group, like ours."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp

    def forward(self, chunk: int, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def backward(self, chunk: int, last: bool) -> contextlib.AbstractContextManager:
        return named_timeouts("DDP's gradient all-reduce", self.ddp.process_group) if last else \
            contextlib.nullcontext()


class FullyShardedSync(GradientSync):
    """FSDP2 at pp = 1: the reduce-scatter only in the last backward (FSDP2 reads the flag in the backward)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def backward(self, chunk: int, last: bool) -> contextlib.AbstractContextManager:
        return gradient_sync(self.model, last)


class AfterLastBackward(GradientSync):
    """parallel.debug_collectives at pp = 1: ReducedAfterBackward's average once the last backward is done."""

    def __init__(self, module: ReducedAfterBackward) -> None:
        self.module = module

    def backward(self, chunk: int, last: bool) -> contextlib.AbstractContextManager:
        return self.module.sync() if last else contextlib.nullcontext()


def data_parallel_step(model: nn.Module, group: ProcessGroup | None, debug_collectives: bool, zero_stage: int,
                       pipelined: bool, bucket_cap_mb: float = BUCKET_CAP_MB) -> tuple[nn.Module, GradientSync]:
    """(what the training forward runs through, how its gradients are averaged over `group`): at pp = 1 DDP
    (ReducedAfterBackward under debug_collectives) or FSDP2 at zero_stage 3, each with its sync; in a pipeline
    (`pipelined`) the model itself, its chunks' gradients averaged by `ChunkReducer` during each chunk's last
    backward, or FSDP2 reduce-scattering in each backward. Experts split over ep ranks are left to finalize_grads,
    which averages them over the ranks holding them."""
    if group_size(group) == 1:
        return model, GradientSync()
    if zero_stage == 3:
        sharded = shard_fully(model, mesh_of(group))
        return sharded, GradientSync() if pipelined else FullyShardedSync(sharded)
    experts = list(split_experts(model))
    if pipelined:
        params = dict(model.named_parameters())
        left_out = {id(params[name]) for name in experts}
        return model, ChunkReducer([[p for p in chunk if id(p) not in left_out] for chunk in chunk_parameters(model)],
                                   group)
    if debug_collectives:
        reduced = ReducedAfterBackward(model, group, set(experts))
        return reduced, AfterLastBackward(reduced)
    if experts:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_cap_mb,
                                  gradient_as_bucket_view=True, **_NO_BUFFER_SYNC)
    return ddp, DDPSync(ddp)
