"""How the layers are cut into pipeline stages, and which virtual stages a pipeline rank holds.

V = pp x v virtual stages (v model chunks per rank, `interleaved_1f1b`); virtual stage k is chunk k // pp of
pipeline rank k % pp (Megatron's interleaving: consecutive virtual stages sit on consecutive ranks, so every chunk
boundary is one hop). Without `parallel.pipeline_layers` the split balances each virtual stage's cost: its layers,
plus the embedding on the first and the output layer with its loss on the last, each weighed by its training FLOPs
per token (`StageCosts.of`, from the model's FLOP count). The output layer of a large vocabulary costs several
layers: at h 128 and an 8,192-token vocabulary about 4.6 (counted as one layer, it left a last stage whose forwards
a user measured at ~3x the first's). Every layer is built exactly once, or the config is refused before any process
group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..transformer.model_config import ModelConfig
from ..transformer.model_flops import (embedding_flops_per_token, layer_flops_per_token, loss_flops_per_token,
                                       output_layer_flops_per_token)
from ..transformer.pipeline_stage import PipelineStage


@dataclass(frozen=True)
class StageCosts:
    """What a layer, the embedding and the head (output layer and loss) cost, in one unit (FLOPs per token from
    `of`; the default counts each as one layer, for callers without a model config)."""

    layer: float = 1.0
    embedding: float = 1.0
    head: float = 1.0

    @staticmethod
    def of(cfg: ModelConfig, seq_len: int) -> "StageCosts":
        """Each part's training FLOPs per token at sequence length `seq_len`."""
        return StageCosts(layer_flops_per_token(cfg, seq_len), embedding_flops_per_token(cfg),
                          output_layer_flops_per_token(cfg) + loss_flops_per_token(cfg))

    def of_rank(self, stage: PipelineStage, num_layers: int) -> float:
        """What a pipeline rank's stage costs: its layers, and the embedding and head it holds."""
        layers = sum(len(r) for r in stage.layer_ranges(num_layers))
        return layers * self.layer + self.embedding * stage.has_embedding + self.head * stage.has_head

    def of_stage(self, k: int, stages: int, layers: int) -> float:
        """Virtual stage k's cost (of `stages`) holding `layers` layers."""
        return layers * self.layer + (self.embedding if k == 0 else 0) + (self.head if k == stages - 1 else 0)


def balanced_split(num_layers: int, stages: int, costs: StageCosts = StageCosts()) -> list[int]:
    """Layers per virtual stage (each >= 1) with the stages' costs as even as they can be (the least sum of squared
    costs: exact by dynamic programming); on a tie the earlier stages take fewer layers (under 1F1B they hold the
    most activations)."""
    if num_layers < stages:
        raise ValueError(f"model.num_layers={num_layers} cannot fill {stages} pipeline stages of at least one layer "
                         "each: lower parallel.pipeline_parallel_size (x virtual_pipeline_stages) or add layers.")
    unit = costs.layer  # squared costs in layers: the same choice, and no float overflow at real sizes

    def cost(stage: int, layers: int) -> float:
        return costs.of_stage(stage, stages, layers) / unit

    # after[left]: (score, split) of the stages after the current one holding `left` layers between them
    after: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}
    for stage in reversed(range(stages)):
        here = {}
        for left in range(stages - stage, num_layers + 1):  # each stage from this one on needs a layer
            options = [(cost(stage, n) ** 2 + after[left - n][0], n, [n] + after[left - n][1])
                       for n in range(1, left + 1) if left - n in after]
            if options:
                score, _, split = min(options, key=lambda option: option[:2])
                here[left] = (score, split)
        after = here
    return after[num_layers][1]


def stage_layer_counts(num_layers: int, pp: int, v: int, pipeline_layers: list[int] | None,
                       costs: StageCosts = StageCosts()) -> list[int]:
    """Layers per virtual stage: `parallel.pipeline_layers` checked, or the split balanced by `costs`."""
    stages = pp * v
    if pipeline_layers is None:
        return balanced_split(num_layers, stages, costs)
    if len(pipeline_layers) != stages or sum(pipeline_layers) != num_layers or min(pipeline_layers) < 1:
        raise ValueError(
            f"parallel.pipeline_layers={list(pipeline_layers)} must give each of the {stages} virtual stages "
            f"(pipeline_parallel_size={pp} x virtual_pipeline_stages={v}) at least one layer and "
            f"model.num_layers={num_layers} in all (it gives {sum(pipeline_layers)} over {len(pipeline_layers)}): "
            f"fix the list, or leave it out for a balanced split.")
    return list(pipeline_layers)


def virtual_stages(num_layers: int, pp: int, v: int, pipeline_layers: list[int] | None,
                   costs: StageCosts = StageCosts()) -> list[range]:
    """Every virtual stage's layers, in model order."""
    counts = stage_layer_counts(num_layers, pp, v, pipeline_layers, costs)
    starts = [sum(counts[:k]) for k in range(len(counts))]
    return [range(start, start + n) for start, n in zip(starts, counts)]


def rank_stage(num_layers: int, pp: int, v: int, pipeline_layers: list[int] | None, pp_rank: int,
               costs: StageCosts = StageCosts()) -> PipelineStage:
    """What pipeline rank `pp_rank` holds: its v chunks, chunk c being virtual stage c pp + pp_rank."""
    return _stage_of(virtual_stages(num_layers, pp, v, pipeline_layers, costs), pp, v, pp_rank)


def rank_stages(num_layers: int, pp: int, v: int, pipeline_layers: list[int] | None,
                costs: StageCosts = StageCosts()) -> list[PipelineStage]:
    """What every pipeline rank holds, in rank order (the split computed once)."""
    stages = virtual_stages(num_layers, pp, v, pipeline_layers, costs)
    return [_stage_of(stages, pp, v, r) for r in range(pp)]


def _stage_of(stages: list[range], pp: int, v: int, pp_rank: int) -> PipelineStage:
    chunks = tuple((stages[c * pp + pp_rank].start, stages[c * pp + pp_rank].stop) for c in range(v))
    return PipelineStage(chunks, has_embedding=pp_rank == 0, has_head=pp_rank == pp - 1)
