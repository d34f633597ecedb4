"""The run summary's mixture-of-experts row, from the config alone: total and active parameters (a token runs k of
the E experts of each MoE layer) and what each GPU holds at the run's expert-parallel size.

    experts      128 experts (top-8, ffn 768) in 48 of 48 layers; 30.53B parameters, 3.35B active per token;
                 ep 16: 8 experts a rank, 3.35B parameters, 28.4 GiB/rank of weights, gradients and AdamW (ZeRO-3)
"""

from __future__ import annotations


def _attention(m) -> int:
    a = m.attention_config()
    qkv = m.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    biases = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim * m.qkv_bias + m.hidden_size * m.out_bias
    return qkv + a.num_heads * a.head_dim * m.hidden_size + biases + sum(a.qk_norm_widths())


def _mlp(m, width: int) -> int:
    return width * m.hidden_size * (3 if m.activation == "swiglu" else 2)


def parameter_counts(m) -> dict[str, int]:
    """{"total", "active" (per token), "experts" (the routed experts' weights)} of a ModelConfig."""
    norms = m.hidden_size * (1 if m.norm == "rmsnorm" else 2)
    total = m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2) + norms
    total += m.max_seq_len * m.hidden_size if m.position_embedding == "learned" else 0
    experts = active_experts = 0
    for i in range(m.num_layers):
        total += _attention(m) + 2 * norms
        if not m.is_moe_layer(i):
            total += _mlp(m, m.resolved_ffn_hidden_size())
            continue
        shared = _mlp(m, m.moe_shared_expert_ffn_hidden_size) + m.hidden_size * m.moe_shared_expert_gate
        total += m.num_experts * m.hidden_size + shared  # the router, the shared expert
        experts += m.num_experts * _mlp(m, m.resolved_moe_ffn_hidden_size())
        active_experts += m.moe_top_k * _mlp(m, m.resolved_moe_ffn_hidden_size())
    return {"total": total + experts, "active": total + active_experts, "experts": experts}


def _bytes_per_parameter(zero_stage: int, shards: int) -> float:
    """float32 weights, gradients and AdamW's two moments of a parameter over `shards` ranks: the moments divided
    by them under ZeRO-1, everything under ZeRO-3 (as the pipeline row counts them)."""
    return 16 / shards if zero_stage == 3 else 8 + 8 / (shards if zero_stage == 1 else 1)


def moe_rows(cfg, world_size: int) -> dict[str, str]:
    """{"experts": ...} for a model with experts, {} without. Per GPU: the experts split over ep, the rest split by
    tp where the layers shard it (taken as all of it: an upper bound), in float32 with gradients and AdamW's two
    moments; ZeRO divides the rest over dp x cp and the split experts over the dp x cp / ep ranks that hold the
    same ones (ZeRO-1 leaves them out: `experts_beside_zero`)."""
    m, par = cfg.model, cfg.parallel
    if not m.num_experts:
        return {}
    ep, data_context = par.expert_parallel_size, world_size // (par.tensor_parallel_size * par.pipeline_parallel_size)
    counts = parameter_counts(m)
    layers = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    rest, experts = (counts["total"] - counts["experts"]) / par.tensor_parallel_size, counts["experts"] / ep
    per_rank = rest + experts
    experts_zero = 0 if ep > 1 and par.zero_stage == 1 else par.zero_stage
    gib = (rest * _bytes_per_parameter(par.zero_stage, data_context)
           + experts * _bytes_per_parameter(experts_zero, max(1, data_context // ep))) / 2**30
    return {"experts": f"{m.num_experts} experts (top-{m.moe_top_k}, ffn {m.resolved_moe_ffn_hidden_size()}) in "
                       f"{layers} of {m.num_layers} layers; {counts['total'] / 1e9:.2f}B parameters, "
                       f"{counts['active'] / 1e9:.2f}B active per token; ep {ep}: {m.num_experts // ep} experts a "
                       f"rank, {per_rank / 1e9:.2f}B parameters, {gib:.1f} GiB/rank of weights, gradients and AdamW"
                       f"{' (ZeRO-%d)' % par.zero_stage if par.zero_stage else ''}"}
