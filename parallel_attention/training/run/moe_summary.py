"""The run summary's mixture-of-experts row, from the config alone: total and active parameters (a token runs k of
the E experts of each MoE layer) and what each GPU holds at the run's layout: its training state and an estimate
of its activations' peak.

    experts      128 experts (top-8, ffn 768) in 48 of 48 layers; 30.53B parameters, 3.35B active per token;
                 ep 16: 8 experts a rank, 3.35B parameters, 28.4 GiB/rank of weights, gradients and AdamW (ZeRO-3)
                 + about 14.2 GiB of activations at micro-batch 1 (full recomputation) = 42.6 GiB/rank
"""

from __future__ import annotations

from ..activation_memory import layer_activation_bytes, layer_activation_terms
from ..optim import state_bytes_per_parameter


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


def moe_layer_activation_bytes(m, seq_len: int, batch: int, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """Bytes one MoE layer keeps for backward (float32; int64 indices), as `layer_activation_terms` counts a dense
    layer's, its MLP term replaced by the router's and the experts': the router's [T, E] logits, scores and their
    log-sum-exp's input; for the T k rows, the dispatched input, the experts' output and its gated product [T k, h]
    each, the activation's tensors as a dense MLP's (SwiGLU 4 f, GELU 2 f a row) and three int64 indices. The
    experts run on a rank's own tokens: T = s b (/ p under SP)."""
    terms = layer_activation_terms(m, seq_len, batch, tp_size, sequence_parallel)
    tokens = seq_len * batch // (tp_size if sequence_parallel else 1)
    f, rows = m.resolved_moe_ffn_hidden_size(), tokens * m.moe_top_k
    activation = 4 * f if m.activation == "swiglu" else 2 * f
    experts = 4 * (3 * tokens * m.num_experts + rows * (3 * m.hidden_size + activation)) + 3 * 8 * rows
    return sum(terms.values()) - terms["mlp"] + experts


def activation_gib(cfg) -> float:
    """An estimate of the activations' peak on a rank at pp 1 (GiB): one micro-batch's saved tensors in float32 (an
    upper bound under bf16 autocast): each layer's (`layer_activation_bytes`, `moe_layer_activation_bytes`), or under
    full recomputation every layer's input and one layer's whole; plus the logits and their gradient (float32, this
    rank's vocabulary shard)."""
    m, par = cfg.model, cfg.parallel
    s, b, p, sp = cfg.data.seq_len // par.context_parallel_size, cfg.training.micro_batch_size, \
        par.tensor_parallel_size, par.sequence_parallel
    granularity = m.recompute_granularity if m.recompute_activations else "none"
    recomputed = layer_activation_terms(m, s, b, p, sp)["attention logsumexp (float32)"] * (granularity == "selective")
    dense, moe = layer_activation_bytes(m, s, b, p, sp), moe_layer_activation_bytes(m, s, b, p, sp)
    layers = [(moe if m.is_moe_layer(i) else dense) - recomputed for i in range(m.num_layers)]
    if granularity == "full":
        saved = m.num_layers * layer_activation_bytes(m, s, b, p, sp, "full") + max(layers)
    else:
        saved = sum(layers)
    return (saved + 2 * 4 * s * b * m.vocab_size / p) / 2**30


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
    state = (rest * state_bytes_per_parameter(par.zero_stage, data_context)
             + experts * state_bytes_per_parameter(experts_zero, max(1, data_context // ep))) / 2**30
    zero = f" (ZeRO-{par.zero_stage})" if par.zero_stage else ""
    memory = f"{state:.1f} GiB/rank of weights, gradients and AdamW{zero}"
    if par.pipeline_parallel_size == 1:  # a pipeline's stages row gives each stage's state
        recompute = m.recompute_granularity if m.recompute_activations else "no"
        activations = activation_gib(cfg)
        tokens = cfg.training.micro_batch_size * cfg.data.seq_len // par.context_parallel_size
        memory += (f" + about {activations:.1f} GiB of activations at micro-batch {cfg.training.micro_batch_size} "
                   f"({tokens} tokens a rank, {recompute} recomputation) = {state + activations:.1f} GiB/rank")
    return {"experts": f"{m.num_experts} experts (top-{m.moe_top_k}, ffn {m.resolved_moe_ffn_hidden_size()}) in "
                       f"{layers} of {m.num_layers} layers; {counts['total'] / 1e9:.2f}B parameters, "
                       f"{counts['active'] / 1e9:.2f}B active per token; ep {ep}: {m.num_experts // ep} experts a "
                       f"rank, {per_rank / 1e9:.2f}B parameters, {memory}"}
