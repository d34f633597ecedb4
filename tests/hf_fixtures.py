"""Tiny transformers *ForCausalLM fixtures, one per family parallelize supports: built locally from a config with a
fixed seed (never downloaded), float32, dropout off. Awkward sizes: vocab 301 (divisible by neither 2 nor 4), so a
mis-padded or mis-sliced vocabulary cannot pass; h 64, 2 layers, head dim 16."""

from __future__ import annotations

import torch

VOCAB = 301
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, attention_dropout=0.0, tie_word_embeddings=False)


def _config(name: str):
    import transformers as tf

    rope_llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    configs = {
        "llama3_rope": lambda: tf.LlamaConfig(**_COMMON, num_key_value_heads=2, rope_parameters=rope_llama3),
        "qwen2": lambda: tf.Qwen2Config(**_COMMON, num_key_value_heads=2),
        "qwen3": lambda: tf.Qwen3Config(**_COMMON, num_key_value_heads=2, head_dim=16),
        "mistral_window": lambda: tf.MistralConfig(**_COMMON, num_key_value_heads=2, sliding_window=5),
        "llama_gqa": lambda: tf.LlamaConfig(**{**_COMMON, "num_attention_heads": 8}, num_key_value_heads=4,
                                            head_dim=8),
        "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
        "mqa_tied_bias": lambda: tf.LlamaConfig(**{**_COMMON, "tie_word_embeddings": True}, num_key_value_heads=1,
                                                attention_bias=True, mlp_bias=True),
    }
    return configs[name]()


FAMILIES = ["llama3_rope", "qwen2", "qwen3", "mistral_window", "llama_gqa", "gpt2", "mqa_tied_bias"]


def build(name: str):
    """The fixture `name`, its weights drawn from seed 0 (every rank builds the same model), in eval mode.
    Biases and norm weights are randomised too, so that a dropped bias or norm cannot pass."""
    import transformers as tf

    config = _config(name)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name or "ln_" in param_name:
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


# parallelize's MoE fixtures: 2 layers, h 32, every expert FFN split in two at p = 2; the router's aux loss on
# (output_router_logits) with a coefficient large enough to move the gradients
_MOE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, output_router_logits=True,
            router_aux_loss_coef=0.1)
MOE_FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=16, mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, head_dim=8,
                                         norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, eos_token_id=None)),
    # one k/v head at p = 2: the head and its rows of the whole-projection k norm replicated on both ranks
    "olmoe_one_kv_head": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, eos_token_id=None,
                                              num_key_value_heads=1)),
}


def build_moe(name: str, **overrides):
    """The MoE fixture `name` (MOE_FAMILIES), seed 0, every parameter perturbed (routers and norms off their
    initial values, each expert's gate and up halves distinct), in eval mode."""
    import transformers as tf

    config_class, extra = MOE_FAMILIES[name]
    config = getattr(tf, config_class)(**{**_MOE, **extra, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.05)
    return model.eval()


def gpt_model_logits(cfg, canonical: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [b, s, V] of GPTModel(cfg) holding `canonical`, on this rank's tensor-parallel group
    (eval: an imported GPT-2 keeps its dropout rates)."""
    import parallel_attention as pa
    from parallel_attention.tensor_parallel.collectives import all_gather_along_dim

    model = pa.GPTModel(cfg).eval()
    model.load_canonical_state_dict(canonical)
    with torch.no_grad():
        local = model(tokens)  # [s, b, V_padded / p]
    full = all_gather_along_dim(local, -1, pa.get_tensor_model_parallel_group())[..., :cfg.vocab_size]
    return full.transpose(0, 1)


# float32, same weights: only summation orders differ (and the split across ranks), ~1e-7 relative
LOGITS_TOLERANCE = 1e-4


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference, relative to the largest reference logit."""
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def gpt_logits_worker(cases, tokens: torch.Tensor):
    """On each rank: gpt_model_logits of every (cfg, canonical) in `cases`."""
    return [gpt_model_logits(cfg, canonical, tokens) for cfg, canonical in cases]


def save_perturbed_hf_model(config_cls: str, model_cls: str, fields: dict, path, tokens: torch.Tensor,
                            **save_kwargs):
    """A seeded transformers model, every parameter perturbed (so no bias or norm weight sits at its initial value),
    saved at `path`; returns it (eval mode) and its logits on `tokens`."""
    import transformers as tf

    torch.manual_seed(0)
    model = getattr(tf, model_cls)(getattr(tf, config_cls)(**fields)).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():  # tied parameters are listed once
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(path, **save_kwargs)
    with torch.no_grad():
        return model, model(tokens).logits


def hf_logits(path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits on `tokens` of the model saved at `path`."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(tokens).logits
