"""ZeRO-3 (parallel.zero_stage: 3): parameters, gradients and AdamW state sharded across the data-parallel ranks
with torch's FSDP2 (`fully_shard`), on top of our tensor parallelism.

    tensor-parallel  ours: each rank's parameters are plain-tensor shards (heads, MLP columns/rows, vocab)
    data-parallel    FSDP2 over the 1-D dp x cp mesh (`get_data_context_parallel_mesh`: the mesh's "dp"
                     dimension at cp = 1) shards each rank's local tensors along dim 0: every TransformerLayer
                     is one group and the root (embeddings, final norm, head) another. Parameters are
                     replicated across cp, so, as DDP and ZeRO-1 do, FSDP2 shards and reduces over dp x cp

    forward:   each group all-gathers its parameters over dp (x cp) just before it runs, and frees them after
    backward:  all-gathered again, then the gradients are reduce-scattered (averaged) over dp (x cp): each rank keeps
               the dim-0 shard of its gradient, a DTensor. finalize_grads sums the tensor-parallel partial rows
               on those shards (the two sums commute), the global norm adds the shards over dp
               (`tensor_parallel.grad_clip`), and AdamW updates the local shards only
    checkpoint: DTensors gathered over dp (`checkpointing.state_encoding.gathered`): the files are those of
               zero_stage 0; loading cuts the whole tensors again, so any (p, dp, zero_stage) resumes any other

Experts split over ep ranks (MoE, `ExpertShard`) differ between the ranks of an ep group: each MoE layer's experts
module is its own group first (`shard_split_experts`), over the dp x cp / ep ranks that hold the same experts, as
torchtitan and Megatron shard them; the layer's group then leaves them out, as nested `fully_shard` groups do.

FSDP2's all-gathers and reduce-scatters are issued through `tensor_parallel.collectives` (its custom-comm hooks,
`NamedAllGather`, `NamedReduceScatter`): a timeout raises CollectiveTimeoutError naming the operation and the
group, and `parallel.debug_collectives` records and cross-checks them like every other collective.

Accumulation micro-batches skip the reduce-scatter (`set_requires_gradient_sync(False)`, data_parallel). The
model object stays the one the trainer holds (FSDP2 changes its class in place): checkpoints, the audit and
evaluation read it as at the other stages.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..tensor_parallel.collectives import all_gather_into_tensor, reduce_scatter_tensor
from ..tensor_parallel.expert_shards import split_experts
from ..tensor_parallel.mesh_groups import device_type
from ..tensor_parallel.parallel_state import ProcessGroup, get_data_context_parallel_mesh


def mesh_of(group: ProcessGroup | None) -> DeviceMesh:
    """The 1-D mesh FSDP2 shards over for the gradient-reduction `group` (None: the world): the job's dp x cp mesh
    where `group` is its group, else one made on `group` (`DeviceMesh.from_group`, no new group)."""
    mesh = get_data_context_parallel_mesh()
    if mesh is not None and mesh.get_group() is group:
        return mesh
    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device_type())


class _EmptyBuffers:
    """FSDP2's comm protocol: the buffer a collective writes into (torch's default allocation)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class NamedAllGather(_EmptyBuffers):
    """FSDP2's parameter all-gather (forward, and again in the backward) through `collectives`."""

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return all_gather_into_tensor(output_tensor, input_tensor, group, async_op, name="FSDP2's parameter all_gather")


class NamedReduceScatter(_EmptyBuffers):
    """FSDP2's gradient reduce-scatter (the backward of each micro-batch that syncs) through `collectives`."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        return reduce_scatter_tensor(output_tensor, input_tensor, group, async_op, reduce_op=op,
                                     name="FSDP2's gradient reduce_scatter")


def shard_split_experts(model: nn.Module) -> None:
    """`fully_shard` each module of experts split over ep > 1 ranks over the ranks that hold the same experts
    (`ExpertShard.expert_data_group`; at ep = dp x cp this rank alone): its reduce-scatter sums their gradients
    there, and `reduce_expert_grads` divides by dp x cp, as at zero_stage 0."""
    for module_name, kind in {name.rpartition(".")[0]: kind for name, kind in split_experts(model).items()}.items():
        experts = shard_through_ours(model.get_submodule(module_name), mesh_of(kind.expert_data_group))
        experts.set_gradient_divide_factor(1.0)  # with forced SUM: no division in FSDP2, even on one rank
        experts.set_force_sum_reduction_for_comms(True)


def shard_fully(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """`fully_shard` each of `model.layers` and then the root over `dp_mesh` (a 1-D mesh), their collectives
    issued through ours, after the split experts over their own ranks (`shard_split_experts`); returns `model`."""
    shard_split_experts(model)
    for module in (*model.layers, model):
        shard_through_ours(module, dp_mesh)
    return model


def shard_through_ours(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """`fully_shard(module)` over `mesh`, its all-gathers and reduce-scatters issued through `collectives`."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=mesh)
    module.set_custom_all_gather(NamedAllGather())
    module.set_custom_reduce_scatter(NamedReduceScatter())
    return module


@contextlib.contextmanager
def gradient_sync(model: nn.Module, reduce: bool):
    """One micro-batch of an FSDP2 model: reduce-scatter its gradients in the backward only when `reduce`."""
    model.set_requires_gradient_sync(reduce)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
