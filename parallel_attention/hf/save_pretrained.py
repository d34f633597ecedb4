"""`save_pretrained(model, out_dir)`: a `parallelize`d transformers model written back as a transformers directory.

A collective: every rank of the model's group gathers the full weights of the parallel modules (each module's
`hf_state_dict`, under transformers' names); the modules transformers still owns (norms, learned positions) are
replicated and taken as they are. Global rank 0 then writes `config.json` and `model.safetensors`, each
atomically (`checkpointing.tensor_io.write_atomic`), and every rank waits for it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes
from torch import nn

from ..checkpointing.tensor_io import cpu_tensors, write_atomic
from ..launch.rank_zero import is_rank_zero
from ..tensor_parallel.collectives import barrier
from .parallelize import tp_group_of


def full_hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded transformers state dict of a `parallelize`d model (a collective; every rank gets it)."""
    tp_group_of(model)  # refuse a model that was not parallelized
    full: dict[str, torch.Tensor] = {}
    parallel: list[str] = []
    for name, module in model.named_modules():
        gather = getattr(module, "hf_state_dict", None)
        if gather is None or any(name.startswith(prefix) for prefix in parallel):
            continue
        full.update({f"{name}.{key}": tensor for key, tensor in gather().items()})
        parallel.append(f"{name}.")
    for key, tensor in model.state_dict().items():
        if not any(key.startswith(prefix) for prefix in parallel):
            full[key] = tensor.detach()
    if getattr(model.config, "tie_word_embeddings", False):
        full.pop("lm_head.weight", None)
    return full


def save_pretrained(model: nn.Module, out_dir: str | Path) -> Path:
    """Write `model` (made tensor parallel by `parallelize`) to `out_dir` as transformers' `from_pretrained`
    reads it: config.json and model.safetensors with the full weights. A collective; global rank 0 writes."""
    out = Path(out_dir)
    tensors = cpu_tensors(full_hf_state_dict(model))
    if is_rank_zero():
        out.mkdir(parents=True, exist_ok=True)
        config = json.loads(model.config.to_json_string(use_diff=False))
        config["architectures"] = [type(model).__name__]
        write_atomic(out / "config.json", [json.dumps(config, indent=2, sort_keys=True).encode() + b"\n"])
        write_atomic(out / "model.safetensors", [safetensors_bytes(tensors, metadata={"format": "pt"})])
    barrier()
    return out
