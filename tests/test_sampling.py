"""Epochs without replacement and weighted blends: properties of the order every run reads its data in."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel_attention.training.data.read.batches import EpochWindows, blend, draws_before, feistel_permutation


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 100, 1000, 4097])
def test_the_feistel_order_is_a_permutation(n):
    assert sorted(feistel_permutation(np.arange(n), n, (1, 2, 3)).tolist()) == list(range(n))


def test_each_key_gives_another_order_and_the_same_key_the_same():
    a = feistel_permutation(np.arange(1000), 1000, (7, 0, 0))
    assert np.array_equal(a, feistel_permutation(np.arange(1000), 1000, (7, 0, 0)))
    for other in [(7, 0, 1), (7, 1, 0), (8, 0, 0)]:
        assert (a != feistel_permutation(np.arange(1000), 1000, other)).mean() > 0.9
    # shuffled: not the identity, and no long runs of consecutive windows
    assert (np.diff(a.astype(np.int64)) == 1).mean() < 0.02


def test_one_epoch_reads_every_window_once_and_no_token_is_an_input_twice():
    tokens, seq_len = 10_007, 64
    windows = EpochWindows(tokens, seq_len, seed=3, source_index=0)
    offsets, epochs = windows.offsets(np.arange(windows.num_windows))
    assert (epochs == 0).all()
    inputs = np.concatenate([np.arange(o, o + seq_len) for o in offsets])
    assert len(np.unique(inputs)) == len(inputs)  # no token is an input twice
    assert len(inputs) / tokens >= 0.97  # all but the tail shorter than a window
    assert (offsets + seq_len + 1 <= tokens).all()  # every window and its label token fit
    assert not np.array_equal(offsets, np.sort(offsets))  # shuffled
    second, epochs2 = windows.offsets(np.arange(windows.num_windows, 2 * windows.num_windows))
    assert (epochs2 == 1).all() and sorted(second) == sorted(offsets) and not np.array_equal(second, offsets)


def test_a_seventy_thirty_blend_draws_its_weights():
    sources, draws = blend([0.7, 0.3], 0, 1600)
    assert abs((sources == 0).mean() - 0.70) <= 0.01
    for j in (0, 1):  # each source's draws are 0, 1, 2, ...: no window of a source repeats within its epoch
        assert draws[sources == j].tolist() == list(range((sources == j).sum()))


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.floats(0.02, 1.0), min_size=2, max_size=3), start=st.integers(0, 5000),
       count=st.integers(0, 300))
def test_any_range_of_the_blend_is_a_slice_of_the_whole_and_within_one_of_its_weights(weights, start, count):
    whole_sources, whole_draws = blend(weights, 0, start + count)
    sources, draws = blend(weights, start, count)
    assert np.array_equal(sources, whole_sources[start:]) and np.array_equal(draws, whole_draws[start:])
    share = np.asarray(weights) / np.sum(weights)
    counts = np.zeros(len(weights))
    for i, j in enumerate(whole_sources, 1):
        counts[j] += 1
        assert np.abs(counts - share * i).max() < 1  # two or three sources: always within one sample
    assert np.array_equal(draws_before(weights, start + count), counts)
