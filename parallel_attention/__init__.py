"""Megatron-style tensor-parallel self-attention for PyTorch (NCCL on GPUs, gloo on CPUs)."""

from .apex_kernels import active_paths
from .attention import ParallelSelfAttention
from .attention_config import AttentionConfig
from .grads import finalize_grads
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .parallel_state import (
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    init_distributed,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from .random import manual_seed

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "ColumnParallelLinear",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "active_paths",
    "destroy_model_parallel",
    "finalize_grads",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "init_distributed",
    "initialize_model_parallel",
    "manual_seed",
    "model_parallel_is_initialized",
]
