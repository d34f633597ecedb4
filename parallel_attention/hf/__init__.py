"""Hugging Face interchange: Llama, Mistral, Qwen2, Qwen3 and GPT-2 configs and weights <-> canonical state dicts.

Owns the config mapping (`config`), the per-family weight rules (`weights`) and import/export
(`convert`). transformers itself is never imported here: files are read with safetensors and
JSON. May import `tensor_parallel`, `transformer` and `checkpointing.tensor_io`.
`parallelize` and `save_pretrained` take a loaded transformers model (transformers' attention functions are
imported lazily, at its first forward): see `parallelize`.
"""

from .config import FAMILY, read_hf_config
from .convert import canonical_to_hf, hf_to_canonical, missing_tokenizer_message, tokenizer_is_missing
from .parallelize import parallelize
from .save_pretrained import save_pretrained
