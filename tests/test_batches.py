"""Batches from a blend of sources: a pure function of (seed, step), split over data-parallel ranks, epochs
without replacement, weights kept, validation from held-out documents only, and the previous release's draw."""

import numpy as np
import pytest
import torch

from parallel_attention.training.data.read.batches import GlobalBatchSampler
from parallel_attention.training.data.read.validation import validation_batches
from parallel_attention.training.data.indexed_dataset import IndexedDatasetWriter, token_dtype
from parallel_attention.training.data.token_files import DataFileError
from parallel_attention.training.data.read.token_source import open_source
from parallel_attention.transformer.cross_entropy import IGNORE_INDEX

VOCAB = 300


def _megatron_prefix(path, num_documents, seed, vocab=VOCAB, lengths=(5, 90)):
    """A Megatron-LM indexed dataset of random documents, each ending in end-of-text id 0."""
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(path, token_dtype(vocab))
    for _ in range(num_documents):
        writer.add_document(np.append(rng.integers(1, min(vocab, VOCAB), rng.integers(*lengths)), 0))
    writer.finish()
    return str(path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    return [open_source(_megatron_prefix(root / name, n, seed), 0.1, (VOCAB, "byte"))
            for name, n, seed in (("web", 300, 1), ("code", 120, 2))]


def test_the_global_batch_is_a_pure_function_of_seed_and_step(sources):
    sampler = GlobalBatchSampler(sources, [0.7, 0.3], 16, 8, seed=7)
    again = GlobalBatchSampler(sources, [0.7, 0.3], 16, 8, seed=7)
    batch = sampler.global_batch(3)
    assert batch.shape == (8, 17) and batch.dtype == torch.long
    assert torch.equal(batch, again.global_batch(3))
    assert not torch.equal(batch, sampler.global_batch(4))
    assert not torch.equal(GlobalBatchSampler(sources, [0.7, 0.3], 16, 8, seed=8).global_batch(3), batch)


@pytest.mark.parametrize("dp_size, micro_batch_size", [(1, 8), (2, 2), (4, 1), (8, 1)])
def test_the_union_over_dp_ranks_is_the_global_batch(sources, dp_size, micro_batch_size):
    sampler = GlobalBatchSampler(sources, [0.7, 0.3], 16, 8, seed=1234, document_masking=True)
    rows = [torch.cat([mb[0] for mb in sampler.local_micro_batches(5, r, dp_size, micro_batch_size)])
            for r in range(dp_size)]
    assert torch.equal(torch.cat(rows), sampler.global_batch(5)[:, :-1])


def test_one_epoch_reads_every_window_of_a_source_once(sources):
    sampler = GlobalBatchSampler(sources[:1], [1.0], 16, 8, seed=3)
    per_epoch = sampler.windows[0].num_windows
    steps = -(-per_epoch // 8)
    rows = [sampler.rows(step) for step in range(steps)]
    offsets = np.concatenate([r.offset for r in rows])
    epochs = np.concatenate([r.epoch for r in rows])
    first = offsets[epochs == 0]
    assert len(first) == per_epoch and len(np.unique(first)) == per_epoch and (first % 16 == 0).all()
    assert (epochs[per_epoch:] == 1).all()
    assert sampler.epochs(steps) == {sources[0].name: round(steps * 8 / per_epoch, 4)}


def test_a_blend_keeps_its_weights_without_repeating_a_window_in_an_epoch(sources):
    sampler = GlobalBatchSampler(sources, [0.7, 0.3], 8, 16, seed=0)
    rows = [sampler.rows(step) for step in range(100)]  # 1,600 samples
    source = np.concatenate([r.source for r in rows])
    assert abs((source == 0).mean() - 0.70) <= 0.01
    for j in (0, 1):
        offsets = np.concatenate([r.offset[r.source == j] for r in rows])
        epochs = np.concatenate([r.epoch[r.source == j] for r in rows])
        for epoch in np.unique(epochs):
            assert len(np.unique(offsets[epochs == epoch])) == (epochs == epoch).sum()


def test_random_windows_draw_what_the_previous_release_drew(sources):
    sampler = GlobalBatchSampler(sources[:1], [1.0], 16, 8, seed=11, sampling="random_windows")
    generator = torch.Generator().manual_seed((11 * 1_000_003 + 4) % (1 << 63))  # the previous release's formula
    expected = torch.randint(0, sources[0].train.num_tokens - 16, (8,), generator=generator)
    assert np.array_equal(sampler.rows(4).offset, expected.numpy())
    with pytest.raises(ValueError, match="random_windows reads a single source"):
        GlobalBatchSampler(sources, [0.5, 0.5], 16, 8, seed=0, sampling="random_windows")


def test_validation_comes_from_held_out_documents_of_every_source(sources):
    batches = validation_batches(sources, [0.7, 0.3], 16, 4, 3, document_masking=True)
    again = validation_batches(sources, [0.7, 0.3], 16, 4, 3, document_masking=True)
    assert len(batches) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    for source in sources:
        train_docs = set(source.train.segment_document.tolist())
        val_docs = set(source.val.segment_document.tolist())
        assert val_docs and not train_docs & val_docs
        assert len(val_docs) == round(source.num_documents * 0.1)
    halves = [validation_batches(sources, [0.7, 0.3], 16, 4, 3, dp_rank=r, dp_size=2) for r in range(2)]
    assert all(torch.equal(torch.cat([h0[0], h1[0]]), whole[0]) for h0, h1, whole in zip(*halves, batches))


def test_document_ids_follow_the_windows_and_boundary_labels_are_ignored(sources):
    sampler = GlobalBatchSampler(sources, [0.7, 0.3], 32, 8, seed=5, document_masking=True)
    for tokens, labels, documents in sampler.local_micro_batches(2, 0, 1, 4):
        boundary = documents[:, 1:] != documents[:, :-1]
        assert boundary.any()
        assert (labels[:, :-1][boundary] == IGNORE_INDEX).all()
        # each document ends with end-of-text (0): a boundary follows an eot token
        assert (tokens[:, :-1][boundary] == 0).all()


def test_a_megatron_prefix_with_an_id_outside_the_vocabulary_is_refused_naming_the_file(tmp_path):
    prefix = _megatron_prefix(tmp_path / "wide", 50, 0, vocab=70_000, lengths=(60, 61))
    source = open_source(prefix, 0.1, (256, "byte"))
    with pytest.raises(DataFileError, match=r"wide\.bin holds token id \d+, outside the vocabulary \[0, 256\)"):
        GlobalBatchSampler([source], [1.0], 16, 8, seed=0).global_batch(0)
