"""Megatron-LM indexed datasets of random documents for the data tests: each document 5-89 random ids in [1, vocab)
then end-of-text 0, as a byte or small BPE tokenizer would write them."""

from __future__ import annotations

import numpy as np

from parallel_attention.training.data.indexed_dataset import IndexedDatasetWriter, token_dtype


def random_prefix(path, num_documents: int, seed: int, vocab: int = 300) -> str:
    """Write PATH.bin / PATH.idx; return the prefix."""
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(path, token_dtype(vocab))
    for _ in range(num_documents):
        writer.add_document(np.append(rng.integers(1, vocab, rng.integers(5, 90)), 0))
    writer.finish()
    return str(path)
