"""Transformer blocks on the tensor-parallel layers: attention, MLP, norms, loss and the GPT model.

Owns AttentionConfig and ModelConfig (the model's own config lives with the model), the core
attention kernels (`kernels/`: SDPA / the CPU kernel / math / apex, apex imported lazily; the ring's pair
kernels), rotary embedding, the KV cache,
ParallelSelfAttention, ParallelMLP, the norms, vocab-parallel cross entropy, GPTModel with its
canonical key layout (`model_layout`), and sampling (`generation`).
May import `tensor_parallel` only.
"""

from ..tensor_parallel.sharding import padded_vocab_size
from .kernels.apex_kernels import apex_available
from .attention import ParallelSelfAttention
from .attention_config import AttentionConfig
from .cross_entropy import vocab_parallel_cross_entropy
from .generation import generate, generate_batch
from .kernels.kernel_paths import active_paths
from .kv_cache import KVCache
from .mlp import ParallelMLP
from .model import GPTModel
from .model_config import ModelConfig
from .model_layout import shard_state_dict, state_dict_keys, unshard_state_dict
