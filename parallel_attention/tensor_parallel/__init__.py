"""Tensor-parallel machinery: the bottom layer, independent of any model.

Owns the device mesh and its process groups (`parallel_state`, the one place that creates them), every collective
(`collectives`: the autograd region functions of the forward/backward pass, the primitives the linears call, the
context-parallel ring exchange and all-to-all, the timeout hook, and the plain reductions that training and
checkpointing use; `collective_log`, the guard that checks each one across ranks), the parallel layers, the RNG
(one default generator on every rank, a tensor-parallel generator for dropout), the declaration of parameter kinds
with `finalize_grads`, and the pure canonical <-> shard functions (`sharding`).
Imports torch only: nothing from the rest of the package.
"""

from .audit import replica_mismatches
from .collective_log import CollectiveMismatchError, enable_collective_log
from .collectives import CollectiveTimeoutError, all_gather_along_dim
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from .parallel_state import (
    destroy_model_parallel,
    get_context_parallel_group,
    get_context_parallel_rank,
    get_context_parallel_world_size,
    get_data_context_parallel_group,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_device_mesh,
    get_expert_data_parallel_group,
    get_expert_model_parallel_group,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    init_distributed,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from .param_kinds import (KvReplica, PartialGrad, Replicated, Sharded, finalize_grads, parameter_kinds,
                          removed_name_error)
from .rng import (
    checkpoint_with_tp_rng,
    get_tensor_parallel_rng_state,
    manual_seed,
    set_tensor_parallel_rng_state,
    tensor_parallel_rng,
)


def __getattr__(name: str):
    """A name removed in 0.4 (`param_kinds.REMOVED_NAMES`: `Partial`) is refused with what replaces it."""
    raise removed_name_error(__name__, name)
