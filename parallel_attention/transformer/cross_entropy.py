"""Cross entropy over vocabulary-parallel logits, without ever gathering the full logits.

Each rank holds logits [s, b, V/p] for its slice of the (padded) vocabulary. Two all-reduces
per call: the max (for a stable softmax) and, stacked together, the sum of exponentials and
the target's logit. Columns past the true vocabulary size (padding so V splits evenly) are
masked out, so the loss does not depend on how much padding p requires.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..tensor_parallel.collectives import all_reduce
from ..tensor_parallel.parallel_state import ProcessGroup, group_rank, group_size


IGNORE_INDEX = -100  # the label torch and Hugging Face leave out of the loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """owns_logits: whether the forward may overwrite the logits (vocab_parallel_cross_entropy_). A flag here
    rather than two functions: the two differ in which buffer the first pass writes, nothing else."""

    @staticmethod
    def forward(ctx, logits, target, vocab_size, group, owns_logits: bool):
        per_rank = logits.shape[-1]
        start = group_rank(group) * per_rank
        if logits.dtype in (torch.float16, torch.bfloat16):  # softmax statistics in float32
            logits, owns_logits = logits.float(), True
        if start + per_rank > vocab_size:  # this rank holds padding columns (decided on the host: no sync)
            padding = torch.arange(start, start + per_rank, device=logits.device) >= vocab_size
            fill = logits.masked_fill_ if owns_logits else logits.masked_fill
            logits, owns_logits = fill(padding, float("-inf")), True
        logits_max = all_reduce(logits.amax(dim=-1), group, dist.ReduceOp.MAX)  # amax: no indices, 5x faster
        outside = (target < start) | (target >= start + per_rank)
        local_target = (target - start).masked_fill(outside, 0)
        # one [.., V/p] buffer for the shifted logits, their exponentials and the softmax, in place: each fresh
        # buffer of that size costs a page-faulting allocation as large as the pass over it (CPU). Where the
        # caller hands the logits over (owns_logits), that buffer is theirs: no [.., V/p] allocation at all.
        exp = logits.sub_(logits_max.unsqueeze(-1)) if owns_logits else logits - logits_max.unsqueeze(-1)
        target_logit = exp.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp.exp_()
        stats = all_reduce(torch.stack([exp.sum(dim=-1), target_logit]), group)
        sum_exp, target_logit = stats[0], stats[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), outside, local_target)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - onehot(target), this rank's columns only
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (~outside).to(grad.dtype).neg().unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_size: int, group: ProcessGroup | None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-token loss [...] from this rank's logits [..., V_padded/p] and global targets [...].

    Targets equal to `ignore_index` get loss 0 and no gradient (as F.cross_entropy(reduction="none")
    does); any other target outside [0, vocab_size) is refused, at every p.
    """
    return _cross_entropy(logits, target, vocab_size, group, ignore_index, owns_logits=False)


def vocab_parallel_cross_entropy_(
    logits: torch.Tensor, target: torch.Tensor, vocab_size: int, group: ProcessGroup | None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """vocab_parallel_cross_entropy that overwrites `logits` with its softmax (and, in backward, with their
    gradient): for a caller that made the logits for this loss alone and keeps no other use of them. What
    produced them must not need them for its own backward (a linear keeps its input and weight, not its output);
    one that did would fail loudly at its backward (autograd's version check), not compute wrong gradients.
    Half-precision logits are upcast into a buffer of the loss's own, and the caller's are left alone."""
    return _cross_entropy(logits, target, vocab_size, group, ignore_index, owns_logits=True)


def _cross_entropy(logits, target, vocab_size: int, group, ignore_index: int, owns_logits: bool) -> torch.Tensor:
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} does not match logits {tuple(logits.shape)}[:-1].")
    if vocab_size > logits.shape[-1] * group_size(group):
        raise ValueError(f"vocab_size={vocab_size} exceeds the padded vocabulary {logits.shape[-1] * group_size(group)}.")
    ignored = check_labels(target, vocab_size, ignore_index)
    loss = _VocabParallelCrossEntropy.apply(logits, target.masked_fill(ignored, 0), vocab_size, group, owns_logits)
    return loss.masked_fill(ignored, 0.0)


def check_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The mask of the ignored labels, once every other label is checked to lie in [0, vocab_size) (check_ids)."""
    ignored = labels == ignore_index
    check_ids(labels.masked_fill(ignored, 0), vocab_size, "label")
    return ignored


def check_ids(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    """ValueError naming the first id outside [0, vocab_size), for ids on the host. On an accelerator the check
    is asynchronous (a device-side assert, no host sync per forward): the trainer checks its batches on the host
    first (`training.micro_batch_step.on_device`), and so should a caller that wants the message."""
    outside = (ids < 0) | (ids >= vocab_size)
    if ids.device.type != "cpu":
        torch._assert_async(~outside.any(), f"a {what} id is outside the vocabulary [0, {vocab_size})")
        return
    if outside.any():
        value = ids[outside].flatten()[0].item()
        raise ValueError(f"{what} id {value} is outside the vocabulary [0, {vocab_size}): check the tokenizer "
                         f"against model.vocab_size (ignored labels must be exactly {IGNORE_INDEX}).")
