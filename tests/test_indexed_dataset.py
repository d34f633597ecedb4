"""Megatron-LM's indexed dataset format: the bytes written, the arrays read back, and the refusals.

The layout is checked byte for byte against the format's description (not against our own reader), and, where
megatron-core is importable, against megatron-core's IndexedDataset itself.
"""

import struct

import numpy as np
import pytest

from parallel_attention.training.data.document_split import validation_mask
from parallel_attention.training.data.indexed_dataset import (IndexedDatasetWriter, IndexedTokens, IndexFormatError,
                                                              token_dtype)

DOCUMENTS = [np.array([5, 6, 7, 0]), np.array([1, 0]), np.array([9, 9, 9, 9, 9, 0])]


def _write(prefix, documents=DOCUMENTS, vocab=300):
    writer = IndexedDatasetWriter(prefix, token_dtype(vocab))
    for doc in documents:
        writer.add_document(doc)
    writer.finish()
    return prefix


def test_the_index_is_megatrons_mmidx_layout_byte_for_byte(tmp_path):
    _write(tmp_path / "shard")
    lengths, pointers = [4, 2, 6], [0, 8, 12]  # uint16: 2 bytes a token
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<QQ", 3, 4)
                + np.array(lengths, "<i4").tobytes() + np.array(pointers, "<i8").tobytes()
                + np.array([0, 1, 2, 3], "<i8").tobytes())
    assert (tmp_path / "shard.idx").read_bytes() == expected
    assert (tmp_path / "shard.bin").read_bytes() == np.concatenate(DOCUMENTS).astype("<u2").tobytes()
    assert not list(tmp_path.glob("*.tmp"))


def test_documents_read_back_and_the_dtype_follows_megatrons_rule(tmp_path):
    data = IndexedTokens(_write(tmp_path / "shard"))
    assert data.num_documents == 3 and data.num_tokens == 12 and data.dtype == np.uint16
    assert [data.document(i).tolist() for i in range(3)] == [d.tolist() for d in DOCUMENTS]
    assert token_dtype(65_499) == np.uint16 and token_dtype(65_500) == np.int32
    wide = IndexedTokens(_write(tmp_path / "wide", [np.array([70_000, 0])], vocab=100_000))
    assert wide.dtype == np.int32 and wide.document(0).tolist() == [70_000, 0]


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.with_suffix(".idx").write_bytes(b"NOTANIDX" * 8), "not a Megatron-LM indexed-dataset index"),
    (lambda p: p.with_suffix(".bin").write_bytes(b"\x00" * 6), "has 6 bytes but"),
    (lambda p: p.with_suffix(".idx").write_bytes(p.with_suffix(".idx").read_bytes()[:40]), "cut short"),
    (lambda p: p.with_suffix(".bin").unlink(), "does not exist"),
])
def test_a_damaged_pair_is_refused_naming_the_file(tmp_path, damage, message):
    prefix = _write(tmp_path / "shard")
    damage(prefix)
    with pytest.raises(IndexFormatError, match=message) as error:
        IndexedTokens(prefix)
    assert "shard" in str(error.value)


def test_validation_takes_every_nth_document_and_never_all():
    assert validation_mask(10, 0.2).nonzero()[0].tolist() == [4, 9]
    assert validation_mask(3, 0.02).nonzero()[0].tolist() == [2]  # too few for the rule: the last one
    assert not validation_mask(1, 0.5).any()
    mask = validation_mask(100_000, 0.01)
    assert mask.sum() == 1000 and not mask[:99].any()


def test_megatron_core_reads_what_we_write(tmp_path):
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")  # an extra check where it is installed
    prefix = _write(tmp_path / "shard")
    theirs = indexed.IndexedDataset(str(prefix))
    assert len(theirs) == 3
    assert [theirs[i].tolist() for i in range(3)] == [d.tolist() for d in DOCUMENTS]
