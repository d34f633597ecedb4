"""The class defaults of the config fields of each architecture the Hugging Face converter reads and writes, and
the fields it ignores or carries. Which architectures those are is `families.FAMILIES`, the one registry.

    architecture         model_type  weights   what it adds to the Llama block
    LlamaForCausalLM     llama       llama     attention_bias (q, k, v and o together), mlp_bias
    MistralForCausalLM   mistral     llama     no biases; sliding_window (folded into max_seq_len)
    Qwen2ForCausalLM     qwen2       llama     bias on q, k, v only; sliding window per layer (folded)
    Qwen3ForCausalLM     qwen3       llama     RMSNorm over each head's q and k (qk_norm); attention_bias
    GPT2LMHeadModel      gpt2        gpt2      (its own family: learned positions, LayerNorm, GELU)
    MixtralForCausalLM   mixtral     llama     Mistral's block with a mixture of experts (top-k renormalised)
    Qwen2MoeForCausalLM  qwen2_moe   llama     Qwen2's block with experts, a gated shared expert, dense layers
    Qwen3MoeForCausalLM  qwen3_moe   llama     Qwen3's block with experts (norm_topk_prob), dense layers
    OlmoeForCausalLM     olmoe       llama     experts in every layer (norm_topk_prob); RMSNorm over the whole q
                                               and k projections (qk_norm_scope 'projection'); clip_qkv null only

A field absent from config.json takes the Hugging Face class default listed here, as from_pretrained would.
"""

from __future__ import annotations

# Hugging Face class defaults of the fields read (what from_pretrained assumes when a field is absent).
LLAMA = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
             max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
             mlp_bias=False, attention_dropout=0.0, initializer_range=0.02, rope_theta=10000.0,
             rope_scaling=None, rope_parameters=None, partial_rotary_factor=None, pretraining_tp=1)
MISTRAL = {**{k: v for k, v in LLAMA.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")},
           "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
           "sliding_window": 4096}
QWEN2 = {**{k: v for k, v in LLAMA.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")},
         "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
         "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
         "max_window_layers": 28, "layer_types": None}
QWEN3 = {**QWEN2, "head_dim": 128, "attention_bias": False}
GPT2 = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
            activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
            layer_norm_epsilon=1e-5, initializer_range=0.02, scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, add_cross_attention=False,
            tie_word_embeddings=True)

_MOE = dict(num_experts_per_tok=2, output_router_logits=False, router_aux_loss_coef=0.001)
MIXTRAL = {**MISTRAL, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
           "sliding_window": None, **_MOE, "num_local_experts": 8, "router_jitter_noise": 0.0}
QWEN2_MOE = {**QWEN2, "intermediate_size": 5632, "num_key_value_heads": 16, "sliding_window": 0, **_MOE,
             "num_experts_per_tok": 4, "num_experts": 60, "moe_intermediate_size": 1408,
             "shared_expert_intermediate_size": 5632, "norm_topk_prob": False, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "qkv_bias": True}
QWEN3_MOE = {**QWEN3, "intermediate_size": 6144, "num_key_value_heads": 4, "sliding_window": None, **_MOE,
             "num_experts_per_tok": 8, "num_experts": 128, "num_local_experts": None, "moe_intermediate_size": 768,
             "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
OLMOE = {**{k: v for k, v in LLAMA.items() if k not in ("mlp_bias", "pretraining_tp")}, **_MOE,
         "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048, "num_hidden_layers": 16,
         "num_attention_heads": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "clip_qkv": None,
         "num_experts_per_tok": 8, "num_experts": 64, "router_aux_loss_coef": 0.01, "norm_topk_prob": False}

# Fields that do not change the forward: identity, bookkeeping, generation, other heads of GPT-2.
NOT_MATH = {"architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
            "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
            "output_attentions", "output_hidden_states", "return_dict", "torchscript", "id2label", "label2id",
            "problem_type", "tokenizer_class", "prefix", "task_specific_params", "chunk_size_feed_forward",
            "is_encoder_decoder", "n_ctx", "summary_type", "summary_use_proj", "summary_activation",
            "summary_proj_to_labels", "summary_first_dropout", "output_router_logits", "router_jitter_noise"}
CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id")  # kept from the source config on export

