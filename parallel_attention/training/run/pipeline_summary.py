"""The run summary's pipeline rows: each stage's layers, parameters and training-state memory per rank, and the
schedule's bubble formula (the measured bubble is each metrics row's `pipeline_bubble`).

Memory per rank is the state that lives through the step: weights, gradients and AdamW's two moments in float32
(16 bytes a parameter; the moments divided by dp under ZeRO-1, everything by dp under ZeRO-3), the stage's
parameters divided by tp. Activations come on top: under 1f1b stage 0 holds at most pp micro-batches of them.
"""

from __future__ import annotations

from ...pipeline.layout import virtual_stages
from ...pipeline.schedules import schedule


def _parameters_per_stage(cfg, layer_parameters: int) -> list[int]:
    m, par = cfg.model, cfg.parallel
    h, vocab = m.hidden_size, m.vocab_size
    embedding = vocab * h + (m.max_seq_len * h if m.position_embedding == "learned" else 0)
    head = vocab * h + 2 * h  # the output layer (a copy of the table when tied) and the final norm, roughly
    pp, v = par.pipeline_parallel_size, par.virtual_pipeline_stages
    stages = virtual_stages(m.num_layers, pp, v, par.pipeline_layers)
    counts = [0] * pp
    for k, layers in enumerate(stages):
        counts[k % pp] += len(layers) * layer_parameters + (embedding if k == 0 else 0) + \
            (head if k == len(stages) - 1 else 0)
    return counts


def _gigabytes_per_rank(cfg, parameters: int, dp: int) -> float:
    par = cfg.parallel
    per_rank = parameters / par.tensor_parallel_size
    state = 8 + 8 / (dp if par.zero_stage >= 1 else 1)  # weights + gradients, then the two AdamW moments
    return per_rank * (16 / dp if par.zero_stage == 3 else state) / 2**30


def layer_parameters(cfg) -> int:
    """A transformer layer's parameters, from the config: q, k, v and output projections, the MLP, two norms."""
    m, a = cfg.model, cfg.model.attention_config()
    qkv = m.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    attention = qkv + a.num_heads * a.head_dim * m.hidden_size
    mlp = m.resolved_ffn_hidden_size() * m.hidden_size * (3 if m.activation == "swiglu" else 2)
    return attention + mlp + 2 * m.hidden_size


def pipeline_rows(cfg, world_size: int, micro_batches: int) -> dict[str, str]:
    """{"pipeline": ..., "stages": ...} for a run at pp > 1 ({} otherwise), from the config alone."""
    par = cfg.parallel
    pp, v = par.pipeline_parallel_size, par.virtual_pipeline_stages
    if pp == 1:
        return {}
    dp = world_size // (par.tensor_parallel_size * par.context_parallel_size * pp)
    stages = virtual_stages(cfg.model.num_layers, pp, v, par.pipeline_layers)
    words = []
    for s, parameters in enumerate(_parameters_per_stage(cfg, layer_parameters(cfg))):
        held = [f"{r.start}-{r.stop - 1}" for k, r in enumerate(stages) if k % pp == s]
        words.append(f"stage {s}: layers {', '.join(held)}{' + embedding' if s == 0 else ''}"
                     f"{' + head' if s == pp - 1 else ''}, {parameters / 1e6:.4g}M parameters, "
                     f"{_gigabytes_per_rank(cfg, parameters, dp):.3g} GiB/rank of weights, gradients and AdamW")
    chosen = schedule(par.pipeline_schedule)
    return {"pipeline": f"{pp} stages{f' x {v} chunks' if v > 1 else ''}, {chosen.name}, {micro_batches} "
                        f"micro-batches: bubble {chosen.formula} = {chosen.bubble(pp, micro_batches, v):.3f} (measured: "
                        f"metrics' pipeline_bubble)",
            "stages": "; ".join(words)}
