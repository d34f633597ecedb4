"""How the layers are cut into pipeline stages, and which virtual stages a pipeline rank holds.

V = pp x v virtual stages (v model chunks per rank, `interleaved_1f1b`); virtual stage k is chunk k // pp of
pipeline rank k % pp (Megatron's interleaving: consecutive virtual stages sit on consecutive ranks, so every chunk
boundary is one hop). Without `parallel.pipeline_layers` the split balances each virtual stage's cost, counting the
embedding as one layer on the first and the output layer with its loss as one layer on the last (Megatron's
`account_for_embedding_in_pipeline_split`): e.g. 30 layers at pp 4 -> [7, 8, 8, 7]. Every layer is built exactly
once, or the config is refused before any process group exists.
"""

from __future__ import annotations

from ..transformer.pipeline_stage import PipelineStage

EMBEDDING_COST = HEAD_COST = 1.0  # in layers


def balanced_split(num_layers: int, stages: int) -> list[int]:
    """Layers per virtual stage (each >= 1) with the stages' costs as even as they can be (the least sum of squared
    costs: exact by dynamic programming), the embedding and the head counted as a layer each; on a tie the earlier
    stages take fewer layers (under 1F1B they hold the most activations)."""
    if num_layers < stages:
        raise ValueError(f"model.num_layers={num_layers} cannot fill {stages} pipeline stages of at least one layer "
                         "each: lower parallel.pipeline_parallel_size (x virtual_pipeline_stages) or add layers.")

    def cost(stage: int, layers: int) -> float:
        return layers + (EMBEDDING_COST if stage == 0 else 0) + (HEAD_COST if stage == stages - 1 else 0)

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


def stage_layer_counts(num_layers: int, pp: int, v: int, pipeline_layers: list[int] | None) -> list[int]:
    """Layers per virtual stage: `parallel.pipeline_layers` checked, or the balanced split."""
    stages = pp * v
    if pipeline_layers is None:
        return balanced_split(num_layers, stages)
    if len(pipeline_layers) != stages or sum(pipeline_layers) != num_layers or min(pipeline_layers) < 1:
        raise ValueError(
            f"parallel.pipeline_layers={list(pipeline_layers)} must give each of the {stages} virtual stages "
            f"(pipeline_parallel_size={pp} x virtual_pipeline_stages={v}) at least one layer and "
            f"model.num_layers={num_layers} in all (it gives {sum(pipeline_layers)} over {len(pipeline_layers)}): "
            f"fix the list, or leave it out for a balanced split.")
    return list(pipeline_layers)


def virtual_stages(num_layers: int, pp: int, v: int, pipeline_layers: list[int] | None) -> list[range]:
    """Every virtual stage's layers, in model order."""
    counts = stage_layer_counts(num_layers, pp, v, pipeline_layers)
    starts = [sum(counts[:k]) for k in range(len(counts))]
    return [range(start, start + n) for start, n in zip(starts, counts)]


def rank_stage(num_layers: int, pp: int, v: int, pipeline_layers: list[int] | None, pp_rank: int) -> PipelineStage:
    """What pipeline rank `pp_rank` holds: its v chunks, chunk c being virtual stage c pp + pp_rank."""
    stages = virtual_stages(num_layers, pp, v, pipeline_layers)
    chunks = tuple((stages[c * pp + pp_rank].start, stages[c * pp + pp_rank].stop) for c in range(v))
    return PipelineStage(chunks, has_embedding=pp_rank == 0, has_head=pp_rank == pp - 1)


def describe_split(num_layers: int, pp: int, v: int, pipeline_layers: list[int] | None) -> str:
    """'stage 0: layers 0-6 + embedding; stage 1: layers 7-14; ...' for the run summary."""
    words = []
    stages = virtual_stages(num_layers, pp, v, pipeline_layers)
    for k, layers in enumerate(stages):
        extra = (" + embedding" if k == 0 else "") + (" + output layer and loss" if k == len(stages) - 1 else "")
        where = f"stage {k % pp}" + (f" chunk {k // pp}" if v > 1 else "")
        words.append(f"{where}: layers {layers.start}-{layers.stop - 1}{extra}")
    return "; ".join(words)
