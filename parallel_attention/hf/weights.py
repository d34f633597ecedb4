"""Hugging Face tensors <-> the canonical state dict: one table of rules per family, read both ways.

A `Rule` ties one Hugging Face tensor to the canonical tensor(s) it holds, with its expected shape
(derived from the config) and the two layout maps, each the other's inverse. Shape legend: h hidden,
f ffn, V vocab, P positions, nh/nkv heads, d head dim, i layer.

    Llama / Mistral / Qwen2 / Qwen3 (nn.Linear [out, in], as canonical: plain copies)
      model.embed_tokens.weight                 [V, h]       embed_tokens.weight
      model.layers.i.input_layernorm.weight     [h]          layers.i.input_norm.weight
      model.layers.i.self_attn.q_proj.{weight,bias} [nh d, h]    layers.i.attention.q_proj.*  (also k, v [nkv d, h])
      model.layers.i.self_attn.o_proj.{weight,bias} [h, nh d]    layers.i.attention.o_proj.*
      model.layers.i.self_attn.{q,k}_norm.weight [d]   layers.i.attention.{q,k}_norm.weight  (Qwen3, qk_norm)
                                 OLMoE: [nh d], [nkv d] (qk_norm_scope 'projection')
      model.layers.i.post_attention_layernorm.weight             layers.i.post_attention_norm.weight
      model.layers.i.mlp.{gate,up}_proj.*       [f, h]       layers.i.mlp.{gate,up}_proj.*
      model.layers.i.mlp.down_proj.*            [h, f]       layers.i.mlp.down_proj.*
      model.norm.weight                                      final_norm.weight
      MoE layers (Mixtral, Qwen2/3-MoE, OLMoE): model.layers.i.mlp.gate.weight [E, h], .experts.gate_up_proj [E, 2f, h],
      .experts.down_proj [E, h, f] (after hf.expert_layouts.fuse_experts), .shared_expert.* and .shared_expert_gate
      [1, h] (Qwen2-MoE): copies, under the same names from layers.i.mlp.
      lm_head.weight  (untied only)             [V, h]       lm_head.weight
    q/k copy without permutation: our rotary is the rotate-half (HF) form over the whole head.

    GPT-2 (Conv1D stores [in, out]: transposed against nn.Linear)
      transformer.wte.weight / wpe.weight       [V, h] / [P, h]   embed_tokens.weight / embed_positions.weight
      transformer.h.i.ln_1.{weight,bias}                     layers.i.input_norm.*
      transformer.h.i.attn.c_attn.weight        [h, 3h]      columns [q | k | v], each transposed -> {q,k,v}_proj.weight
      transformer.h.i.attn.c_attn.bias          [3h]         [q | k | v] -> {q,k,v}_proj.bias
      transformer.h.i.attn.c_proj.weight        [h, h]       transposed -> layers.i.attention.o_proj.weight (+ bias)
      transformer.h.i.ln_2.*                                 layers.i.post_attention_norm.*
      transformer.h.i.mlp.c_fc.weight           [h, f]       transposed -> layers.i.mlp.fc_in.weight (+ bias)
      transformer.h.i.mlp.c_proj.weight         [f, h]       transposed -> layers.i.mlp.fc_out.weight (+ bias)
      transformer.ln_f.*                                     final_norm.*
      lm_head.weight  (untied only)             [V, h]       lm_head.weight

Files: `model.safetensors`, or shards listed by `model.safetensors.index.json`, as save_pretrained writes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from ..checkpointing.tensor_io import cpu_tensors, read_safetensors
from ..transformer.model_config import ModelConfig
from .config import read_json_object

Tensors = dict[str, torch.Tensor]
BASE_PREFIX = {"llama": "model.", "gpt2": "transformer."}
# Buffers some checkpoints carry that hold no weights (causal masks, rotary frequencies).
_BUFFERS = {"llama": re.compile(r".*\.rotary_emb\.inv_freq"), "gpt2": re.compile(r".*\.attn\.(bias|masked_bias)")}
INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


@dataclass(frozen=True)
class Rule:
    hf: str
    canonical: tuple[str, ...]
    hf_shape: tuple[int, ...]
    to_canonical: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    to_hf: Callable[[tuple[torch.Tensor, ...]], torch.Tensor]


def _copy(hf: str, canonical: str, shape: tuple[int, ...]) -> Rule:
    return Rule(hf, (canonical,), shape, lambda t: (t,), lambda ts: ts[0])


def _conv1d(hf: str, canonical: str, shape: tuple[int, ...]) -> Rule:
    """Conv1D weight [in, out] <-> nn.Linear weight [out, in]."""
    return Rule(hf, (canonical,), shape, lambda t: (t.t().contiguous(),), lambda ts: ts[0].t().contiguous())


def _fused_qkv(hf: str, canonical: tuple[str, str, str], shape: tuple[int, ...]) -> Rule:
    """c_attn: weight [h, 3h] (columns q | k | v, each Conv1D-transposed) or bias [3h]."""
    if len(shape) == 2:
        return Rule(hf, canonical, shape, lambda t: tuple(c.t().contiguous() for c in t.chunk(3, dim=1)),
                    lambda ts: torch.cat([c.t() for c in ts], dim=1))
    return Rule(hf, canonical, shape, lambda t: tuple(c.clone() for c in t.chunk(3)), lambda ts: torch.cat(ts))


def _qkv_names(layer: str, kind: str) -> tuple[str, str, str]:
    return tuple(f"{layer}attention.{n}_proj.{kind}" for n in "qkv")


def _llama_rules(cfg: ModelConfig) -> list[Rule]:
    h, f, nh = cfg.hidden_size, cfg.resolved_ffn_hidden_size(), cfg.num_heads
    nkv, d = cfg.num_kv_heads or nh, cfg.head_dim or cfg.hidden_size // nh
    rules = [_copy("model.embed_tokens.weight", "embed_tokens.weight", (cfg.vocab_size, h))]
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        rules.append(_copy(f"{src}input_layernorm.weight", f"{dst}input_norm.weight", (h,)))
        for name, shape in {"q_proj": (nh * d, h), "k_proj": (nkv * d, h), "v_proj": (nkv * d, h),
                            "o_proj": (h, nh * d)}.items():
            rules.append(_copy(f"{src}self_attn.{name}.weight", f"{dst}attention.{name}.weight", shape))
            if cfg.out_bias if name == "o_proj" else cfg.qkv_bias:
                rules.append(_copy(f"{src}self_attn.{name}.bias", f"{dst}attention.{name}.bias", shape[:1]))
        if cfg.qk_norm:  # Qwen3: weights [d], shared by the heads; OLMoE: [nh d] and [nkv d], over the projections
            rules += [_copy(f"{src}self_attn.{n}_norm.weight", f"{dst}attention.{n}_norm.weight", (width,))
                      for n, width in zip("qk", cfg.attention_config().qk_norm_widths())]
        rules.append(_copy(f"{src}post_attention_layernorm.weight", f"{dst}post_attention_norm.weight", (h,)))
        if cfg.is_moe_layer(i):
            rules += _moe_rules(cfg, src, dst)
            continue
        for name, shape in {"gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}.items():
            rules.append(_copy(f"{src}mlp.{name}.weight", f"{dst}mlp.{name}.weight", shape))
            if cfg.mlp_bias:
                rules.append(_copy(f"{src}mlp.{name}.bias", f"{dst}mlp.{name}.bias", shape[:1]))
    rules.append(_copy("model.norm.weight", "final_norm.weight", (h,)))
    return rules


def _moe_rules(cfg: ModelConfig, src: str, dst: str) -> list[Rule]:
    """An MoE layer: the router, the experts in the fused layout (hf.expert_layouts), the shared expert and its gate."""
    h, e, f, s = cfg.hidden_size, cfg.num_experts, cfg.resolved_moe_ffn_hidden_size(), \
        cfg.moe_shared_expert_ffn_hidden_size
    rules = [_copy(f"{src}mlp.gate.weight", f"{dst}mlp.gate.weight", (e, h)),
             _copy(f"{src}mlp.experts.gate_up_proj", f"{dst}mlp.experts.gate_up_proj", (e, 2 * f, h)),
             _copy(f"{src}mlp.experts.down_proj", f"{dst}mlp.experts.down_proj", (e, h, f))]
    if s:
        rules += [_copy(f"{src}mlp.shared_expert.{n}.weight", f"{dst}mlp.shared_expert.{n}.weight", shape)
                  for n, shape in {"gate_proj": (s, h), "up_proj": (s, h), "down_proj": (h, s)}.items()]
    if cfg.moe_shared_expert_gate:
        rules.append(_copy(f"{src}mlp.shared_expert_gate.weight", f"{dst}mlp.shared_expert_gate.weight", (1, h)))
    return rules


def _gpt2_rules(cfg: ModelConfig) -> list[Rule]:
    h, f = cfg.hidden_size, cfg.resolved_ffn_hidden_size()
    rules = [_copy("transformer.wte.weight", "embed_tokens.weight", (cfg.vocab_size, h)),
             _copy("transformer.wpe.weight", "embed_positions.weight", (cfg.max_seq_len, h))]
    for i in range(cfg.num_layers):
        src, dst = f"transformer.h.{i}.", f"layers.{i}."
        rules += [_copy(f"{src}ln_1.{k}", f"{dst}input_norm.{k}", (h,)) for k in ("weight", "bias")]
        rules += [_fused_qkv(f"{src}attn.c_attn.weight", _qkv_names(dst, "weight"), (h, 3 * h)),
                  _fused_qkv(f"{src}attn.c_attn.bias", _qkv_names(dst, "bias"), (3 * h,)),
                  _conv1d(f"{src}attn.c_proj.weight", f"{dst}attention.o_proj.weight", (h, h)),
                  _copy(f"{src}attn.c_proj.bias", f"{dst}attention.o_proj.bias", (h,))]
        rules += [_copy(f"{src}ln_2.{k}", f"{dst}post_attention_norm.{k}", (h,)) for k in ("weight", "bias")]
        rules += [_conv1d(f"{src}mlp.c_fc.weight", f"{dst}mlp.fc_in.weight", (h, f)),
                  _copy(f"{src}mlp.c_fc.bias", f"{dst}mlp.fc_in.bias", (f,)),
                  _conv1d(f"{src}mlp.c_proj.weight", f"{dst}mlp.fc_out.weight", (f, h)),
                  _copy(f"{src}mlp.c_proj.bias", f"{dst}mlp.fc_out.bias", (h,))]
    rules += [_copy(f"transformer.ln_f.{k}", f"final_norm.{k}", (h,)) for k in ("weight", "bias")]
    return rules


def rules_for(cfg: ModelConfig, family: str) -> list[Rule]:
    rules = _gpt2_rules(cfg) if family == "gpt2" else _llama_rules(cfg)
    if not cfg.tie_embeddings:
        rules.append(_copy("lm_head.weight", "lm_head.weight", (cfg.vocab_size, cfg.hidden_size)))
    return rules


# ------------------------------------------------------------------------------ conversion
def hf_to_canonical_tensors(tensors: Tensors, cfg: ModelConfig, family: str, where: str = "") -> Tensors:
    """Canonical state dict from a Hugging Face state dict, every tensor checked against `cfg`."""
    rules, where = rules_for(cfg, family), where or "the Hugging Face state dict"
    prefix = BASE_PREFIX[family]
    if not any(name.startswith(prefix) for name in tensors):  # saved from the base model: no prefix
        tensors = {n if n == "lm_head.weight" else prefix + n: t for n, t in tensors.items()}
    for rule in rules:
        if rule.hf not in tensors:
            raise ValueError(f"tensor {rule.hf} is missing from {where} (config.json implies it, shape "
                             f"{rule.hf_shape}).")
        shape = tuple(tensors[rule.hf].shape)
        if shape != rule.hf_shape:
            raise ValueError(f"tensor {rule.hf} in {where} has shape {shape}, but config.json implies "
                             f"{rule.hf_shape}.")
    # a tied model's lm_head.weight, if saved, is ignored, as transformers ties it to the embedding
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    known = {r.hf for r in rules} | ignored
    unexpected = sorted(n for n in tensors if n not in known and not _BUFFERS[family].fullmatch(n))
    if unexpected:
        raise ValueError(f"{where} holds tensors config.json does not account for: {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}: is it the model config.json describes?")
    return {name: t for rule in rules for name, t in zip(rule.canonical, rule.to_canonical(tensors[rule.hf]))}


def canonical_to_hf_tensors(canonical: Tensors, cfg: ModelConfig, family: str) -> Tensors:
    """Hugging Face state dict from a canonical one (tensors may share the canonical ones' storage)."""
    rules = rules_for(cfg, family)
    expected = {name for rule in rules for name in rule.canonical}
    missing, unexpected = sorted(expected - set(canonical)), sorted(set(canonical) - expected)
    if missing or unexpected:
        raise ValueError(f"canonical state dict does not match the ModelConfig: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}.")
    out = {}
    for rule in rules:
        t = rule.to_hf(tuple(canonical[name].detach().cpu() for name in rule.canonical))
        if tuple(t.shape) != rule.hf_shape:
            shapes = {name: tuple(canonical[name].shape) for name in rule.canonical}
            raise ValueError(f"canonical {shapes} gives {rule.hf} the shape {tuple(t.shape)}; the ModelConfig "
                             f"implies {rule.hf_shape}.")
        out[rule.hf] = t
    return out


# ------------------------------------------------------------------------------ files
def load_hf_tensors(hf_dir: str | Path) -> tuple[Tensors, str]:
    """All tensors of a save_pretrained directory, and a description of where they came from."""
    hf_dir = Path(hf_dir)
    if (hf_dir / SINGLE).is_file():
        return read_safetensors(hf_dir / SINGLE)[0], str(hf_dir / SINGLE)
    if not (hf_dir / INDEX).is_file():
        raise ValueError(f"{hf_dir} holds neither {SINGLE} nor {INDEX} (pickled pytorch_model.bin is not read: "
                         "re-save it with save_pretrained(..., safe_serialization=True)).")
    weight_map = read_json_object(hf_dir / INDEX).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{hf_dir / INDEX} has no weight_map of tensor name -> file name: copy it again.")
    tensors: Tensors = {}
    for file in sorted(set(weight_map.values())):
        if not (hf_dir / file).is_file():
            raise ValueError(f"{hf_dir / INDEX} places tensors in {file}, which is missing from {hf_dir}: copy it "
                             "there.")
        present = read_safetensors(hf_dir / file)[0]  # TensorFileError names a truncated or damaged shard
        for name in (n for n, where in weight_map.items() if where == file):
            if name not in present:
                raise ValueError(f"tensor {name} is missing from {hf_dir / file} ({INDEX} places it there).")
            tensors[name] = present[name]
    return tensors, f"{hf_dir} (sharded, {INDEX})"


def save_hf_tensors(tensors: Tensors, out_dir: Path, max_shard_bytes: int) -> list[str]:
    """model.safetensors, or shards plus an index once the total exceeds max_shard_bytes."""
    tensors = cpu_tensors(tensors)  # contiguous, one storage each: what safetensors accepts
    shards: list[Tensors] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name], size = t, size + nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / SINGLE), metadata={"format": "pt"})
        return [SINGLE]
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for file, shard in zip(files, shards):
        save_file(shard, str(out_dir / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total},
             "weight_map": {name: file for file, shard in zip(files, shards) for name in shard}}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return [*files, INDEX]
