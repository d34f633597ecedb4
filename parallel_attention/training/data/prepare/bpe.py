"""A byte-level BPE trained on the corpus being prepared (data.tokenizer=bpe), kept beside its shards."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ....checkpointing.tensor_io import write_atomic
from ...tokenizer import BPE_EOS, BPE_MIN_VOCAB, HFTokenizer, tokenizers_library

__all__ = ["train_bpe"]


def train_bpe(texts, vocab_size: int, out_path: str | os.PathLike, show_progress: bool = False) -> HFTokenizer:
    """Train a byte-level BPE of `vocab_size` tokens on the strings of `texts`; save it as `out_path` (a
    tokenizer.json) with a tokenizer_config.json beside it naming its end-of-text token; return it loaded.

    Byte-level: the initial alphabet is the 256 byte symbols, so any text encodes and decodes exactly.
    Token 0 is `<|endoftext|>`, the end-of-text token the data pipeline puts between documents. Same texts,
    same tokenizer: the trainer is deterministic. `show_progress`: the `tokenizers` library's own progress bars
    on stderr (it offers no hook to report progress through: its stages only draw bars, or print JSON lines).
    """
    if vocab_size < BPE_MIN_VOCAB:
        raise ValueError(f"bpe vocab_size={vocab_size} is below {BPE_MIN_VOCAB}, the 256 byte symbols plus {BPE_EOS}: "
                         f"set data.bpe_vocab_size >= {BPE_MIN_VOCAB} (8192 to 50000 is usual).")
    lib = tokenizers_library("tokenizer 'bpe'")
    tokenizer = lib.Tokenizer(lib.models.BPE())
    tokenizer.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = lib.decoders.ByteLevel()
    trainer = lib.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOS], show_progress=show_progress,
                                      initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": BPE_EOS, "bos_token": BPE_EOS,
              "add_prefix_space": False}
    write_atomic(out.parent / "tokenizer_config.json", [json.dumps(config, indent=2).encode("utf-8")])
    write_atomic(out, [tokenizer.to_str().encode("utf-8")])
    return HFTokenizer(out)
