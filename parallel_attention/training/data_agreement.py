"""The data verdict every rank shares: a problem with the token files found on any rank refuses the run on all.

Global rank 0 prepares the data while the others wait, then every rank opens and verifies the files. A rank that
raised on its own would leave the others waiting in their next collective until the timeout, and torchrun's report
would name whichever rank failed first. So each step gathers every rank's verdict (a barrier too) and all ranks
raise the same DataFileError, a ConfigError: pretrain.py says `config error: ...` once and every rank exits 2.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from ..tensor_parallel.collectives import all_gather_objects
from .data import TokenDataset
from .token_files import REFUSALS, DataFileError, refusal_message

__all__ = ["agreed", "open_splits"]

T = TypeVar("T")


def agreed(check: Callable[[], T], data_dir) -> T:
    """check()'s result on this rank, once every rank has run its own; DataFileError on every rank, with the
    lowest refusing rank's message, if `check` raised one of token_files.REFUSALS on any rank."""
    refusal, result = None, None
    try:
        result = check()
    except REFUSALS as error:
        refusal = refusal_message(error, data_dir)
    refusal = next((r for r in all_gather_objects(refusal) if r is not None), None)
    if refusal is not None:
        raise DataFileError(refusal)
    return result


def open_splits(data_dir, model_vocab_size: int) -> tuple[TokenDataset, TokenDataset]:
    """The train and val splits, each checked against meta.json's sha256, and their vocabulary against the model's."""
    train, val = TokenDataset(data_dir, "train"), TokenDataset(data_dir, "val")
    if train.vocab_size > model_vocab_size:
        raise DataFileError(f"the data in {data_dir} was prepared with the tokenizer {train.meta['tokenizer']} of "
                            f"{train.vocab_size} tokens (its meta.json) but model.vocab_size={model_vocab_size}: "
                            f"set model.vocab_size >= {train.vocab_size}, or prepare the data with another tokenizer.")
    return train, val
