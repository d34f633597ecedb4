"""ZeRO-1: AdamW state sharded across the data-parallel ranks, on torch's ZeroRedundancyOptimizer.

    step:        every dp rank holds the full, reduced gradient; it updates only the parameters it owns
                 (about 1/dp of them: torch's greedy partition, largest first) with its own AdamW, then each
                 owner broadcasts its updated parameters (one flat buffer) to the other dp ranks
    checkpoint:  consolidate_state_dict(to=0) gathers the shards in memory on dp rank 0, which writes the same
                 optimizer file as an unsharded run (nothing pickled touches the disk)
    load:        every rank is handed the full state dict and keeps its own partition

Each parameter is updated by the same fused AdamW kernel, with the same float operations, as without sharding,
so the losses, the resumed runs and the checkpoints are those of zero_stage 0.
"""

from __future__ import annotations

import functools

import torch

from ..tensor_parallel.collectives import named_timeouts
from ..tensor_parallel.parallel_state import ProcessGroup


def sharded_adamw(param_groups: list[dict], group: ProcessGroup | None, **adamw) -> torch.optim.Optimizer:
    """torch.optim.AdamW over this data-parallel rank's share of the parameters (`param_groups` as for AdamW)."""
    # parameters_as_bucket_view: each rank's parameters become views of one flat buffer, so that the updated
    # parameters travel in one broadcast per rank after each step instead of one per parameter (measured faster)
    return _sharded_adamw_class()(param_groups, optimizer_class=torch.optim.AdamW, process_group=group,
                                  parameters_as_bucket_view=True, **adamw)


@functools.cache
def _sharded_adamw_class() -> type:
    """Defined on first use: importing torch.distributed.optim scripts torch's functional optimizers, which costs
    seconds that `import parallel_attention` must not pay."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class ShardedAdamW(ZeroRedundancyOptimizer):
        def step(self, closure=None):
            """A rank that stops answering during the broadcast of the updated parameters is named, as in every
            other collective, instead of surfacing as the backend's bare timeout."""
            with named_timeouts("ZeRO's parameter broadcast", self.process_group):
                return super().step(closure)

        def consolidate_state_dict(self, to: int = 0) -> None:
            with named_timeouts("ZeRO's optimizer-state consolidation", self.process_group):
                super().consolidate_state_dict(to)

        def state_dict(self) -> dict:
            """The full state, on the rank that consolidate_state_dict(to=) named (every rank calls that first).

            The consolidated copy of the other ranks' shards is dropped once read: the writing rank must not
            keep the whole state between checkpoints, which would undo the sharding on that rank."""
            try:
                return super().state_dict()
            finally:
                self._all_state_dicts = []  # torch keeps it until the next consolidation; its own attribute

        def load_state_dict(self, state_dict: dict) -> None:
            """Keep this rank's partition of a full state dict (as state_dict() returns it).

            The base Optimizer also keeps the owned entries in `self.state`, a second copy on GPU (loaded from a
            CPU file, moved twice); only the local optimizer's copy is used, so drop the other."""
            super().load_state_dict(state_dict)
            self.state.clear()

    return ShardedAdamW


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer-state tensors this rank holds (numel x element size, each tensor once): the whole
    AdamW state for torch's AdamW, this rank's partition for a ZeroRedundancyOptimizer, the local shards of FSDP2's
    DTensor moments."""
    seen, total = set(), 0
    local = getattr(optimizer, "optim", None)  # a ZeroRedundancyOptimizer's own optimizer: its partition
    for states in (optimizer.state, *((local.state,) if local is not None else ())):
        for per_param in states.values():
            for value in (per_param or {}).values():
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    total += tensor_bytes(value)
    return total


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of `tensor`: a DTensor's local shard only (FSDP2's data-parallel part)."""
    local = tensor.to_local() if getattr(tensor, "placements", None) is not None else tensor
    return local.numel() * local.element_size()


def parameter_and_gradient_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the parameters, bytes of their gradients) this rank holds (DTensors: their local shards)."""
    params = list(model.parameters())
    return (sum(tensor_bytes(p) for p in params),
            sum(tensor_bytes(p.grad) for p in params if p.grad is not None))
