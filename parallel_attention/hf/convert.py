"""Hugging Face import/export: a save_pretrained directory <-> (ModelConfig, canonical state dict).

    HF dir: config.json + model.safetensors (or shards + model.safetensors.index.json)
      | hf_config.model_config_from_hf: explicit, validated field mapping  -> ModelConfig
      | hf_weights: one rule table per family, each tensor's shape checked   -> canonical state dict
    (ModelConfig, canonical)  -- GPTModel(cfg).load_canonical_state_dict(canonical) at any p

and back with `canonical_to_hf`, which writes a directory `AutoModelForCausalLM.from_pretrained` loads.
Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM (sliding windows folded into
max_seq_len), GPT2LMHeadModel, and the mixtures of experts MixtralForCausalLM, Qwen2MoeForCausalLM,
Qwen3MoeForCausalLM, OlmoeForCausalLM (experts per expert or fused, `expert_layouts`; see families).
Vocabulary: Hugging Face vocab_size is ModelConfig.vocab_size (GPTModel pads internally; canonical
tensors are unpadded). Tensors keep their stored dtype. Needs safetensors only, not transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..transformer.model_config import ModelConfig
from .config import FAMILY, architecture_of, hf_config_from_model, model_config_from_hf, read_hf_config
from .expert_layouts import fuse_experts, split_experts
from .weights import canonical_to_hf_tensors, hf_to_canonical_tensors, load_hf_tensors, save_hf_tensors

__all__ = ["architecture_of", "canonical_to_hf", "hf_to_canonical", "missing_tokenizer_message", "read_hf_config",
           "tokenizer_is_missing"]

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
MISSING_TOKENIZER_NOTE = "MISSING"  # RUN/tokenizer/MISSING: imported from a directory without tokenizer.json


def hf_to_canonical(hf_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and canonical state dict of a Hugging Face model directory (ValueError naming any misfit)."""
    hf = read_hf_config(hf_dir)
    cfg = model_config_from_hf(hf)
    tensors, where = load_hf_tensors(hf_dir)
    if cfg.num_experts:
        tensors = fuse_experts(tensors, cfg.num_experts, where)
    return cfg, hf_to_canonical_tensors(tensors, cfg, FAMILY[architecture_of(hf)], where)


def canonical_to_hf(model_cfg: ModelConfig, canonical: dict[str, torch.Tensor], out_dir: str | Path,
                    architecture: str | None = None, source_config: dict[str, Any] | None = None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write config.json + model.safetensors (sharded past max_shard_bytes) into a new or empty `out_dir`.

    The architecture is `architecture`, else that of `source_config` (the config.json the model was
    imported from, whose token ids are also kept), else the one `model_cfg`'s shape implies.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty: export into a new directory.")
    hf = hf_config_from_model(model_cfg, architecture, source_config)
    tensors = canonical_to_hf_tensors(canonical, model_cfg, FAMILY[hf["architectures"][0]])
    if model_cfg.num_experts:  # the per-expert layout transformers' save_pretrained writes
        tensors = split_experts(tensors, mixtral=hf["architectures"][0] == "MixtralForCausalLM")
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    hf.update(dtype=dtype, torch_dtype=dtype)  # transformers >= 5 reads dtype, older versions torch_dtype
    out.mkdir(parents=True, exist_ok=True)
    save_hf_tensors(tensors, out, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def missing_tokenizer_message(run_dir: str | Path) -> str:
    """What to do about a run imported without its tokenizer (written into the note, said by generation)."""
    return (f"this model was imported without a tokenizer: copy its tokenizer.json into {Path(run_dir) / 'tokenizer'}/ "
            "or set data.tokenizer=PATH (a tokenizer.json or a directory holding one)")


def tokenizer_is_missing(run_dir: str | Path) -> bool:
    """True for a run imported without a tokenizer to which none has been added since."""
    tokenizer_dir = Path(run_dir) / "tokenizer"
    return (tokenizer_dir / MISSING_TOKENIZER_NOTE).is_file() and not (tokenizer_dir / "tokenizer.json").is_file()
