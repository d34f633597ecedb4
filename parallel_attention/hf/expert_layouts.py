"""The experts of a Hugging Face MoE checkpoint in the two layouts transformers uses, and the fused one the rules read.

    per expert (what transformers 5 save_pretrained writes, and older releases)
      Qwen2/3-MoE, OLMoE  model.layers.i.mlp.experts.e.{gate_proj, up_proj} [f, h], .down_proj [h, f]
      Mixtral      model.layers.i.block_sparse_moe.experts.e.{w1 (gate), w3 (up)} [f, h], .w2 (down) [h, f];
                   its router model.layers.i.block_sparse_moe.gate.weight
    fused (transformers 5's modules, and the canonical state dict's layout)
      model.layers.i.mlp.experts.gate_up_proj [E, 2f, h]  (expert e at row e; [gate | up] along dim 1)
      model.layers.i.mlp.experts.down_proj    [E, h, f]

`fuse_experts` reads either (a layer with a missing expert is refused by name: never a silent drop); `split_experts`
writes the per-expert layout of the family, which the installed transformers loads.
"""

from __future__ import annotations

import re

import torch

Tensors = dict[str, torch.Tensor]
_PER_EXPERT = re.compile(r"(.*layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_ROUTER = re.compile(r"(.*layers\.\d+\.)block_sparse_moe\.gate\.weight")


def fuse_experts(tensors: Tensors, num_experts: int, where: str) -> Tensors:
    """`tensors` with per-expert weights stacked into the fused layout (and Mixtral's router renamed)."""
    out: Tensors = {}
    per_layer: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.fullmatch(name)
        router = _MIXTRAL_ROUTER.fullmatch(name)
        if m:
            prefix, expert, proj = m.groups()
            per_layer.setdefault(prefix, {}).setdefault(_MIXTRAL.get(proj, proj), {})[int(expert)] = t
        elif router:
            out[f"{router.group(1)}mlp.gate.weight"] = t
        else:
            out[name] = t
    for prefix, projections in per_layer.items():
        stacked = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            found = projections.get(proj, {})
            missing = sorted(set(range(num_experts)) - set(found))
            if missing or len(found) != num_experts:
                raise ValueError(f"{where}: {prefix}experts: {proj} of experts {missing or sorted(found)} "
                                 f"{'missing' if missing else 'unexpected'} (config.json implies {num_experts}).")
            stacked[proj] = torch.stack([found[e] for e in range(num_experts)])
        out[f"{prefix}mlp.experts.gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1)
        out[f"{prefix}mlp.experts.down_proj"] = stacked["down_proj"]
    return out


def split_experts(tensors: Tensors, mixtral: bool) -> Tensors:
    """The fused layout written per expert, in the family's names (Mixtral: block_sparse_moe and w1/w3/w2)."""
    out: Tensors = {}
    names = {v: k for k, v in _MIXTRAL.items()} if mixtral else {n: n for n in _MIXTRAL.values()}
    block = "block_sparse_moe" if mixtral else "mlp"
    for name, t in tensors.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[:-len("mlp.experts.gate_up_proj")]
            for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                out[f"{prefix}{block}.experts.{e}.{names['gate_proj']}.weight"] = gate.contiguous()
                out[f"{prefix}{block}.experts.{e}.{names['up_proj']}.weight"] = up.contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[:-len("mlp.experts.down_proj")]
            for e, down in enumerate(t.unbind(0)):
                out[f"{prefix}{block}.experts.{e}.{names['down_proj']}.weight"] = down.contiguous()
        elif mixtral and name.endswith(".mlp.gate.weight"):
            out[name[:-len("mlp.gate.weight")] + "block_sparse_moe.gate.weight"] = t
        else:
            out[name] = t
    return out
