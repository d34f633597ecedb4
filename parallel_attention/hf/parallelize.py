"""`parallelize(model, tp_group)`: a loaded transformers *ForCausalLM made tensor parallel in place.

Each decoder layer's attention and MLP (or sparse MoE block: each expert's FFN split, `tp_moe`), the token
embedding and the output head are replaced by the project's parallel pieces holding this rank's shard (plain
tensors, no DTensor); norms, routers, learned positions and everything else stay transformers' own, replicated.
What the user sees stays transformers': the model's forward, full-vocabulary `.logits`, its `.loss`, `generate`
with its cache (holding this rank's k/v heads), train/eval.

Communication per decoder layer at p > 1: forward 2 all-reduces (attention output, MLP or MoE block output);
backward 2 all-reduces (the dX of the fused QKV and of the fused gate/up GEMM or the MoE block's region), plus
one when p > num_kv_heads (the k/v replicas' weight gradient; OLMoE: two, the k norm's rows too) and one for
Qwen3 (both per-head norm weights); OLMoE's whole-projection q/k norms add one forward and one backward. The
embedding adds one all-reduce forward, the head one all-gather forward (the logits) and one all-reduce backward,
the loss two small all-reduces forward (its vocabulary-parallel cross entropy on this rank's columns: `tp_loss`).
Every gradient is complete when `loss.backward()` returns: no `finalize_grads` call is needed (nor harmful).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..tensor_parallel.parallel_state import (ProcessGroup, group_size, is_distributed, model_parallel_is_initialized,
                                              resolve_tp_group)
from .families import Family, check_supported, family_of
from .tp_attention import TensorParallelAttention
from .tp_embedding import HFVocabParallelEmbedding, VocabParallelHead
from .tp_loss import VocabParallelCausalLMLoss

_MARK = "_parallel_attention_tp_group"


def parallelize(model: nn.Module, tp_group: ProcessGroup | None = None) -> nn.Module:
    """Make `model` (a transformers LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
    GPT2LMHeadModel, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM or OlmoeForCausalLM) tensor
    parallel over `tp_group` (a ProcessGroup or a 1-D DeviceMesh; None: the default tensor-parallel group, or the
    world when none is set up) in place, and return it.

    Every rank must call it with the same model (same weights): each keeps its shard.
    """
    family = family_of(model)
    if hasattr(model, _MARK):
        raise ValueError(f"parallelize: this {type(model).__name__} is already tensor parallel; call it once.")
    group = _resolve(tp_group)
    check_supported(model, family, group_size(group))
    decoder = getattr(model, family.decoder)
    for layer in getattr(decoder, family.layers):
        setattr(layer, family.attention, TensorParallelAttention(getattr(layer, family.attention),
                                                                 family.attention_source, group))
        layer.mlp = family.mlp(layer.mlp, group)
    _parallel_vocabulary(model, family, group)
    setattr(model, _MARK, group)
    return model


def _resolve(tp_group) -> ProcessGroup | None:
    """tp_group as layers resolve it; None without initialize_model_parallel: the whole world (or one rank)."""
    if tp_group is None and not model_parallel_is_initialized():
        return dist.group.WORLD if is_distributed() else None
    return resolve_tp_group(tp_group)


def _parallel_vocabulary(model: nn.Module, family: Family, group) -> None:
    """The embedding and head split by vocabulary rows; a tied head keeps sharing the embedding's shard."""
    decoder = getattr(model, family.decoder)
    old_embedding, old_head = getattr(decoder, family.embedding), model.lm_head
    tied = old_head.weight is old_embedding.weight
    embedding = HFVocabParallelEmbedding(old_embedding.weight, group)
    head = VocabParallelHead(old_head.weight, group)
    if tied:
        head.weight = embedding.weight
    setattr(decoder, family.embedding, embedding)
    model.lm_head = head
    model.loss_function = VocabParallelCausalLMLoss(model.loss_function, head.vocab_size, group)


def tp_group_of(model: nn.Module) -> ProcessGroup | None:
    """The group `parallelize` used on `model`; ValueError if it was not parallelized."""
    if not hasattr(model, _MARK):
        raise ValueError(f"{type(model).__name__} was not made tensor parallel: call parallelize(model) first.")
    return getattr(model, _MARK)
