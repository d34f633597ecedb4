"""Megatron-style tensor-parallel self-attention for PyTorch (NCCL on GPUs, gloo on CPUs).

The stable API (README, "API"); the sub-packages draw the layers of the house, bottom up:
`tensor_parallel` <- `transformer` <- `checkpointing`, `hf` <- `training` <- scripts.
Importing this package needs only torch and the required dependencies.
"""

from .hf.convert import canonical_to_hf, hf_to_canonical
from .hf.parallelize import parallelize
from .tensor_parallel.grad_clip import clip_grad_norm_
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, finalize_grads, manual_seed
from .tensor_parallel.mappings import (copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                                       gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
                                       reduce_scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region)
from .tensor_parallel.parallel_state import (destroy_model_parallel, get_data_parallel_group, get_data_parallel_rank,
                                             get_device_mesh, get_context_parallel_group, get_context_parallel_rank,
                                             get_context_parallel_world_size, get_data_context_parallel_group,
                                             get_data_parallel_world_size, get_tensor_model_parallel_group,
                                             get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                                             init_distributed, initialize_model_parallel, model_parallel_is_initialized)
from .training.config.schema import PretrainConfig, load_config
from .transformer import (AttentionConfig, GPTModel, ModelConfig, ParallelSelfAttention, active_paths,
                          vocab_parallel_cross_entropy)

from .version import __version__  # noqa: E402

__all__ = [
    "AttentionConfig",
    "ColumnParallelLinear",
    "GPTModel",
    "ModelConfig",
    "ParallelSelfAttention",
    "PretrainConfig",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "active_paths",
    "canonical_to_hf",
    "clip_grad_norm_",
    "copy_to_tensor_parallel_region",
    "destroy_model_parallel",
    "finalize_grads",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_device_mesh",
    "get_context_parallel_group",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_data_context_parallel_group",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "hf_to_canonical",
    "init_distributed",
    "initialize_model_parallel",
    "load_config",
    "manual_seed",
    "model_parallel_is_initialized",
    "parallelize",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "vocab_parallel_cross_entropy",
]
