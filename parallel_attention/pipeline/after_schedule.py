"""What follows a step's schedule on every stage, the same for the trainer and the self-check:

    the loss         each micro-batch's loss lives on the last stage; the sum over the pipeline group gives it to
                     every stage, which then logs, clips and judges divergence on the same number
    tied embeddings  the first stage's table and the last stage's copy each get the sum of both gradients, so the
                     two stay equal after the optimizer's step (initialised equal, seeded alike); the global norm
                     counts the copy once (`GPTModel.pipeline_copies`)
"""

from __future__ import annotations

import torch

from ..tensor_parallel.collectives import all_reduce
from ..tensor_parallel.param_kinds import local_shard
from ..tensor_parallel.parallel_state import ProcessGroup
from .step_record import StepRecord


def losses_on_every_stage(record: StepRecord, pp_group: ProcessGroup | None) -> torch.Tensor:
    """Each micro-batch's loss [m] on every stage (the last stage's, summed with the others' zeros)."""
    return all_reduce(record.losses, pp_group)


@torch.no_grad()
def sum_tied_embedding_grads(model: torch.nn.Module, embedding_group: ProcessGroup | None) -> None:
    """Sum the tied table's gradient over the stages that hold it (`embedding_group`: the first and the last;
    None where this rank holds no tied copy, or at pp = 1). Under FSDP2 both stages hold the same data-parallel
    shard, and the sum runs on it."""
    holds_tied = model.config.tie_embeddings and model.embed_tokens is not None
    if embedding_group is None or not holds_tied:
        return
    weight = model.embed_tokens.weight
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    all_reduce(local_shard(weight.grad).tensor, embedding_group)
