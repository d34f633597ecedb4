"""(g) Pipeline parallelism (`--pp P`): a tied-embedding GPTModel of max(4, 2P) layers cut into P stages trains one
step under every schedule and gives what the whole model gives on one rank: the loss, every stage's gradients and
the global gradient norm; and each stage exchanges exactly the activations and gradients its neighbours expect
(counted). Each message is `--pp-message-mib` large (the micro-batches' rows make it so): on NCCL, 64 MiB by
default, beyond its buffering, where a send completes only when its receive has started and an order that could
hang does hang.

Both models are built from the same seed: each part of the model draws its initial weights from its own seeded
generator (`transformer.pipeline_stage`), so the stages hold exactly the whole model's weights without loading any.
"""

from __future__ import annotations

import torch

from ..pipeline.after_schedule import losses_on_every_stage, sum_tied_embedding_grads
from ..pipeline.layout import rank_stage
from ..pipeline.micro_batch_step import MicroBatchStep
from ..pipeline.runner import PipelineRunner
from ..pipeline.schedules import SCHEDULES
from ..tensor_parallel import parallel_state as ps
from ..tensor_parallel.grad_clip import global_grad_norm
from ..tensor_parallel.rng import manual_seed
from ..transformer import GPTModel
from ..transformer.model_config import ModelConfig
from ..transformer.pipeline_stage import PipelineStage
from .collective_counter import count_collectives
from .compare import relative_error, verdict
from .context import CheckContext

SEQ, VOCAB, HIDDEN = 16, 96, 32


def _layers(p: int) -> int:
    """Two layers a stage at least (the interleaved schedule gives each rank two chunks), four in all."""
    return max(4, 2 * p)


def _model(ctx: CheckContext, stage, group, layers: int) -> GPTModel:
    manual_seed(ctx.seed)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=layers, num_heads=4, max_seq_len=SEQ,
                      tie_embeddings=True)
    return GPTModel(cfg, tp_group=group, device=ctx.device, dtype=ctx.dtype, stage=stage)


def message_bytes(mib: float | None, device: torch.device) -> int:
    """`--pp-message-mib` in bytes; by default 64 MiB on GPU (beyond NCCL's buffering), the smallest on CPU."""
    return int((mib or (64 if device.type == "cuda" else 0)) * 2**20)


def message_rows(message_bytes: int, dtype: torch.dtype) -> int:
    """Rows of a micro-batch whose [SEQ, rows, HIDDEN] activation is `message_bytes` large (2 at least)."""
    return max(2, message_bytes // (SEQ * HIDDEN * dtype.itemsize))


def _micro_batches(ctx: CheckContext, m: int, rows: int) -> list[tuple]:
    """(tokens, labels) of each micro-batch, on the device."""
    gen = torch.Generator().manual_seed(ctx.seed + 11)
    return [(torch.randint(0, VOCAB, (rows, SEQ), generator=gen).to(ctx.device),
             torch.randint(0, VOCAB, (rows, SEQ), generator=gen).to(ctx.device)) for _ in range(m)]


def _reference(ctx: CheckContext, batches: list[dict]) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The whole model on this rank alone: mean loss over the micro-batches, gradients by name, their norm (each
    micro-batch's backward at once, so that one micro-batch's activations are held at a time)."""
    p = ps.group_size(ps.get_pipeline_parallel_group())
    model = _model(ctx, PipelineStage(), ctx.solo_group, _layers(p))
    loss = 0.0
    for tokens, labels in batches:
        part = model(tokens, labels) / len(batches)
        part.backward()
        loss = loss + part.detach()
    return loss, {n: p.grad for n, p in model.named_parameters()}, global_grad_norm(model, None)


def _case(ctx: CheckContext, schedule: str, batches, reference) -> tuple[dict[str, float], list[str]]:
    pp_group, p, rank = ps.get_pipeline_parallel_group(), ps.group_size(ps.get_pipeline_parallel_group()), \
        ps.get_pipeline_parallel_rank()
    v = 2 if SCHEDULES[schedule].chunked else 1
    model = _model(ctx, rank_stage(_layers(p), p, v, None, rank), ctx.solo_group, _layers(p))
    runner = PipelineRunner(model, schedule, len(batches), pp_group, ps.get_pipeline_links(), v)
    runner.agree_shapes((SEQ, batches[0][0].shape[0], HIDDEN), ctx.dtype)
    with count_collectives() as counts:
        record = runner.run(MicroBatchStep(model, batches))
    loss = losses_on_every_stage(record, pp_group).sum() / len(batches)
    sum_tied_embedding_grads(model, ps.get_embedding_group())
    norm = global_grad_norm(model, None, pp_group=pp_group, counted_elsewhere=model.pipeline_copies())
    ref_loss, ref_grads, ref_norm = reference
    errors = {f"{schedule} loss": relative_error(loss, ref_loss.cpu().double()),
              f"{schedule} grad norm": relative_error(norm, ref_norm.cpu().double())}
    errors.update({f"{schedule} {n}": relative_error(q.grad, ref_grads[n].cpu().double())
                   for n, q in model.named_parameters()})
    sends = len(batches) * v * 2 - (len(batches) if rank == p - 1 else 0) - (len(batches) if rank == 0 else 0)
    wrong = [f"{schedule}: stage {rank} posted {counts['isend']} sends and {counts['irecv']} receives, "
             f"expected {sends} each"] if (counts["isend"], counts["irecv"]) != (sends, sends) else []
    return errors, wrong


def check_pipeline(ctx: CheckContext, message_bytes: int) -> tuple[bool, str]:
    p = ps.group_size(ps.get_pipeline_parallel_group())
    rows = message_rows(message_bytes, ctx.dtype)
    batches = _micro_batches(ctx, 2 * p, rows)
    reference = _reference(ctx, batches)
    errors, wrong = {}, []
    for schedule in SCHEDULES:
        case_errors, counts = _case(ctx, schedule, batches, reference)
        errors.update(case_errors)
        wrong += counts
    size = SEQ * rows * HIDDEN * ctx.dtype.itemsize
    ok, text = verdict(errors, ctx.dtype, f"pp {p}, {', '.join(SCHEDULES)}, sends and receives counted, messages "
                                          f"of {size / 2**20:.3g} MiB")
    return ok and not wrong, "; ".join([text, *wrong])
