"""The run summary's pipeline rows: each stage's layers, parameters, estimated cost and training-state memory per
rank, and the schedule's bubble formula (the measured bubble is each metrics row's `pipeline_bubble`); and the
model's total parameter count, from the config alone.

A stage's cost is its parts' training FLOPs per token (`pipeline.layout.StageCosts`: what the balanced split
weighs), its share of the step's in percent. Memory per rank is the state that lives through the step: weights,
gradients and AdamW's two moments in float32 (16 bytes a parameter; the moments divided by dp under ZeRO-1,
everything by dp under ZeRO-3), the stage's parameters divided by tp. Activations come on top: under 1f1b stage 0
holds at most pp micro-batches of them.
"""

from __future__ import annotations

from ...pipeline.layout import StageCosts, rank_stages
from ...pipeline.messages import buffers_in_flight
from ...pipeline.schedules import build_schedule, schedule
from ...transformer.pipeline_stage import PipelineStage
from ..optim import state_bytes_per_parameter


def layer_parameters(cfg) -> int:
    """A transformer layer's parameters, from the config: q, k, v and output projections, the MLP, two norms, and
    the biases and q/k norms the config turns on."""
    m, a = cfg.model, cfg.model.attention_config()
    h, f, d, nh, nkv = m.hidden_size, m.resolved_ffn_hidden_size(), a.head_dim, a.num_heads, a.num_kv_heads
    attention = h * (nh + 2 * nkv) * d + nh * d * h + (nh + 2 * nkv) * d * m.qkv_bias + h * m.out_bias \
        + sum(a.qk_norm_widths())
    mlp_in = 2 if m.activation == "swiglu" else 1
    mlp = (mlp_in + 1) * f * h + (mlp_in * f + h) * m.mlp_bias
    return attention + mlp + 2 * _norm_parameters(cfg)


def _norm_parameters(cfg) -> int:
    return cfg.model.hidden_size * (2 if cfg.model.norm == "layernorm" else 1)


def stage_parameters(cfg, stage: PipelineStage) -> int:
    """The parameters a pipeline stage holds (a tied embedding's copy on the last stage included)."""
    m = cfg.model
    layers = sum(len(r) for r in stage.layer_ranges(m.num_layers))
    table = m.vocab_size * m.hidden_size
    embedding = table + (m.max_seq_len * m.hidden_size if m.position_embedding == "learned" else 0)
    head = _norm_parameters(cfg) + table  # the output layer, or the tied table's copy
    return layers * layer_parameters(cfg) + embedding * stage.has_embedding + head * stage.has_head


def total_parameters(cfg) -> int:
    """The model's parameters, every stage's, a tied table counted once."""
    return stage_parameters(cfg, PipelineStage()) - cfg.model.tie_embeddings * cfg.model.vocab_size * \
        cfg.model.hidden_size


def _gigabytes_per_rank(cfg, parameters: int, dp: int) -> float:
    par = cfg.parallel
    return parameters / par.tensor_parallel_size * state_bytes_per_parameter(par.zero_stage, dp) / 2**30


def _flops(value: float) -> str:
    return next(f"{value / scale:.3g} {unit}FLOP" for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""))
                if value >= scale or scale == 1)


def pipeline_rows(cfg, world_size: int, micro_batches: int) -> dict[str, str]:
    """{"pipeline": ..., "stages": ...} for a run at pp > 1 ({} otherwise), from the config alone."""
    par = cfg.parallel
    pp, v = par.pipeline_parallel_size, par.virtual_pipeline_stages
    if pp == 1:
        return {}
    dp = world_size // (par.tensor_parallel_size * par.context_parallel_size * pp)
    costs = StageCosts.of(cfg.model, cfg.data.seq_len)
    stages = rank_stages(cfg.model.num_layers, pp, v, par.pipeline_layers, costs)
    cost = [costs.of_rank(stage, cfg.model.num_layers) for stage in stages]
    words = []
    for s, stage in enumerate(stages):
        parameters = stage_parameters(cfg, stage)
        words.append(f"stage {s}: {stage.describe()}, {parameters / 1e6:.4g}M parameters, "
                     f"{_flops(cost[s])} a token ({100 * cost[s] / sum(cost):.0f} % of the step), "
                     f"{_gigabytes_per_rank(cfg, parameters, dp):.3g} GiB/rank of weights, gradients and AdamW")
    chosen = schedule(par.pipeline_schedule)
    return {"pipeline": f"{pp} stages{f' x {v} chunks' if v > 1 else ''}, {chosen.name}, {micro_batches} "
                        f"micro-batches: bubble {chosen.formula} = {chosen.bubble(pp, micro_batches, v):.3f} (measured: "
                        f"metrics' pipeline_bubble)",
            "stages": "; ".join(words)}


def buffer_row(cfg, micro_batches: int) -> dict[str, str]:
    """{"pipeline buffers": ...}: per stage, the most activation-sized tensors its messages hold at once
    (`messages.buffers_in_flight`); {} at pp = 1."""
    par = cfg.parallel
    pp, v = par.pipeline_parallel_size, par.virtual_pipeline_stages
    if pp == 1:
        return {}
    counts = [buffers_in_flight(build_schedule(par.pipeline_schedule, pp, micro_batches, s, v), s, pp, v)
              for s in range(pp)]
    return {"pipeline buffers": f"at most {', '.join(map(str, counts))} activations in flight on stages "
                                f"0-{pp - 1} (inputs kept for their backward, gradients received, sends not yet "
                                "complete)"}
