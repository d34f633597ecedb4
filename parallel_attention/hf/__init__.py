"""Hugging Face interchange: Llama, Mistral, Qwen2, Qwen3 and GPT-2 configs and weights <-> canonical state dicts.

Owns the config mapping (`config`), the per-family weight rules (`weights`) and import/export
(`convert`), which never import transformers: files are read with safetensors and JSON.
`parallelize` and `save_pretrained` take a loaded transformers model and call into transformers' own modeling
code; every private name they read goes through `transformers_api`, which checks the version first (nothing
here imports transformers when the package is imported). May import `tensor_parallel`, `transformer` and
`checkpointing.tensor_io`.
"""

from .config import FAMILY, read_hf_config
from .convert import canonical_to_hf, hf_to_canonical, missing_tokenizer_message, tokenizer_is_missing
from .parallelize import parallelize
from .save_pretrained import save_pretrained
