"""transformers' causal-LM loss computed on this rank's vocabulary columns: no rank forms the full log-softmax,
and the gradient is only this rank's [b, s, V_padded/p] slice.

`VocabParallelHead` returns transformers the full-vocabulary logits (an all-gather, for `.logits` and generate)
and pins its own output, this rank's columns, to them (`attach_shard`). `parallelize` installs
`VocabParallelCausalLMLoss` as the model's `loss_function`: given those very logits, it takes the pinned columns
(once: a second call on the same logits, or logits that are not the head's, get transformers' own loss) and
computes `ForCausalLMLoss`'s value with `vocab_parallel_cross_entropy_` (two small all-reduces):

    shift (pad the labels with ignore_index, drop the first) unless shift_labels is given;
    per-token loss, 0 where the label is ignore_index;
    sum / num_items_in_batch if given, else the mean over the labels not ignored (NaN if all are, as torch's).

The pinned columns are the head's own buffer, made for this loss alone (the gather copies them into the logits),
so the cross entropy overwrites them in place: no [b, s, V/p] allocation for the softmax or its gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..transformer.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy_

_SHARD = "_parallel_attention_vocab_shard"


def attach_shard(logits: torch.Tensor, shard: torch.Tensor) -> None:
    """Pin this rank's columns `shard` [..., V_padded/p] to the full `logits` the head returns."""
    setattr(logits, _SHARD, shard)


class VocabParallelCausalLMLoss:
    """A transformers `loss_function` for a parallelized *ForCausalLM (see the module docstring)."""

    def __init__(self, fallback, vocab_size: int, group) -> None:
        self.fallback, self.vocab_size, self.group = fallback, vocab_size, group

    def __call__(self, logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = IGNORE_INDEX,
                 shift_labels=None, **kwargs) -> torch.Tensor:
        shard = logits.__dict__.pop(_SHARD, None)
        if shard is None:
            return self.fallback(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if vocab_size != self.vocab_size:
            raise ValueError(f"loss_function: vocab_size={vocab_size} but the head holds {self.vocab_size} rows; "
                             f"pass the model's config.vocab_size.")
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        target = shift_labels.reshape(-1).to(shard.device)
        losses = vocab_parallel_cross_entropy_(shard.view(-1, shard.shape[-1]), target, vocab_size, self.group,
                                               ignore_index)
        if num_items_in_batch is None:
            return losses.sum() / (target != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(losses.device)
        return losses.sum() / num_items_in_batch
