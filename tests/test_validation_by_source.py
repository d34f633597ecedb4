"""A validation loss per source of a blend (issue 39 item 5): each rank's share of every validation batch split by
source holds exactly the rows of the plain validation set, the sums give val_loss as before plus val_loss/<source>,
and a source of one keeps the very micro-batches (so its val_loss is bit-identical to before)."""

import numpy as np
import pytest
import torch

from parallel_attention.training.data.read.validation import validation_batches, validation_batches_by_source
from parallel_attention.training.data.read.token_source import open_source
from parallel_attention.training.data.read.validation import PADDING, source_labels, validation_record
from random_prefixes import random_prefix


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("val")
    return [open_source(random_prefix(root / name, n, seed), 0.1, (300, "byte"))
            for name, n, seed in (("web", 300, 1), ("code", 120, 2), ("math", 80, 3))]


def _rows(batches) -> list[tuple]:
    return sorted(tuple(row.tolist()) for batch in batches for row in batch[0])


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_the_parts_by_source_hold_exactly_the_validation_rows_of_each_rank(sources, dp_size):
    weights = [0.5, 0.3, 0.2]
    for rank in range(dp_size):
        plain = validation_batches(sources, weights, 16, 8, 3, dp_rank=rank, dp_size=dp_size, document_masking=True)
        parts = validation_batches_by_source(sources, weights, 16, 8, 3, dp_rank=rank, dp_size=dp_size,
                                             document_masking=True)
        assert _rows(plain) == _rows(batch for _, batch in parts)
        for source, batch in parts:  # every row of a part comes from its source's validation tokens
            val = sources[source].val
            windows = {tuple(w) for w in val.windows(np.arange(val.num_tokens - 16), 16).tolist()}
            assert all(tuple(row) in windows for row in batch[0].tolist())  # the inputs, labels cut off


def test_a_single_source_keeps_its_micro_batches(sources):
    plain = validation_batches(sources[:1], [1.0], 16, 4, 3, dp_rank=1, dp_size=2)
    parts = validation_batches_by_source(sources[:1], [1.0], 16, 4, 3, dp_rank=1, dp_size=2)
    assert [s for s, _ in parts] == [0] * len(plain)
    assert all(torch.equal(a, b) for (_, pb), qb in zip(parts, plain) for a, b in zip(pb, qb))


def test_the_record_has_the_mean_and_each_sources_loss():
    sums = torch.tensor([[30.0, 10.0], [0.0, 0.0], [8.0, 2.0]], dtype=torch.float64)
    record = validation_record(sums, ["data/web", "/x/code_text_document", "math"])
    assert record == {"val_loss": 38.0 / 12.0, "val_loss/web": 3.0, "val_loss/math": 4.0}
    assert validation_record(sums[:1], ["data/web"]) == {"val_loss": 3.0}
    assert source_labels(["a/web", "b/web"]) == ["a/web", "b/web"]  # the last components would collide


@pytest.mark.parametrize("dp_size", [2, 4])
def test_aligned_parts_give_every_rank_as_many_forwards_and_the_same_rows(sources, dp_size):
    """Expert parallelism's validation (a blend of 3 sources, batches of 3 rows at dp 4: some ranks hold none): every
    rank runs as many micro-batches, the padding is one row and marked, and the rest are the unaligned parts."""
    weights = [0.5, 0.3, 0.2]
    counts = []
    for rank in range(dp_size):
        plain = validation_batches_by_source(sources, weights, 16, 3, 4, dp_rank=rank, dp_size=dp_size)
        aligned = validation_batches_by_source(sources, weights, 16, 3, 4, dp_rank=rank, dp_size=dp_size, aligned=True)
        real = [(s, b) for s, b in aligned if s is not PADDING]
        assert [s for s, _ in real] == [s for s, _ in plain]
        assert all(torch.equal(x, y) for (_, a), (_, b) in zip(real, plain) for x, y in zip(a, b))
        assert all(b[0].shape[0] == 1 for s, b in aligned if s is PADDING)
        counts.append((len(plain), len(aligned)))
    assert len({aligned for _, aligned in counts}) == 1 and len({plain for plain, _ in counts}) > 1
