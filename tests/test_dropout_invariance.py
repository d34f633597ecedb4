"""Layout-invariant dropout (model.dropout_rng='layout_invariant'): every mask is a function of
(seed, step, global sample, layer, site, head or channel, position) only.

Masks are compared with torch.equal: they are pure functions of integer coordinates, so a layout
either reproduces them bit for bit or it is wrong. The end-to-end run compares losses, which do differ
in float rounding across layouts (TP matmul splits, DP means), hence a relative tolerance there.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from launch import torchrun, train_losses
from tiny_run import DROPOUT, tiny_args

import parallel_attention as pa
from parallel_attention.tensor_parallel import dropout_hash
from parallel_attention.tensor_parallel.rng import current_dropout_coordinates, dropout_coordinates
from parallel_attention.transformer.dropout import DropoutSite, build_hidden_dropout

P, SEED, STEP = 0.3, 5, 3
B, S, H, NH = 4, 8, 12, 4  # samples, sequence, hidden, heads: awkward enough that a swapped axis shows

M64 = (1 << 64) - 1


def _splitmix64_draw(key: int, index: int) -> int:
    """splitmix64 at counter `index` of stream `key` without the last xorshift, written out
    independently, as an unsigned 64-bit integer."""
    z = (key + index * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    return ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64


@pytest.mark.parametrize("block", [dropout_hash.BLOCK_ELEMENTS, 9], ids=["one_pass", "blocks_of_one_row"])
def test_mask_matches_a_plain_python_splitmix64(block, monkeypatch):
    monkeypatch.setattr(dropout_hash, "BLOCK_ELEMENTS", block)  # 9 elements: blocks of one row of the axis of 4
    key = dropout_hash.stream_key(SEED, STEP, 1, 2)
    axes = [(3, 2, 5 * 7), (1, 4, 7), (0, 7, 1)]  # a [2, 4, 7] window of a [*, 5, 7] tensor
    mask = dropout_hash.keep_mask(P, key, axes, "cpu")
    for i in range(2):
        for j in range(4):
            for k in range(7):
                index = (3 + i) * 35 + (1 + j) * 7 + k
                # kept when the draw read as a signed int64 is >= -2**63 + p 2**64, i.e. when the draw with
                # its top bit flipped (signed order as unsigned order) is >= p 2**64: probability 1 - p
                kept = _splitmix64_draw(key, index) ^ (1 << 63) >= round(P * 2**64)
                assert bool(mask[i, j, k]) == kept, (i, j, k)


def _peak_bytes(function):
    """(function(), the most bytes the CPU allocator held at once while it ran), from the profiler's memory events."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        result = function()
    events = sorted((e.start_ns(), e.nbytes()) for e in profile.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    held = peak = 0
    for _, change in events:
        held += change
        peak = max(peak, held)
    return result, peak


def test_attention_masks_at_s_4096_are_hashed_in_blocks_at_an_eighth_of_one_pass_peak(monkeypatch):
    """One head's [4096, 4096] probabilities: one pass holds int64 tensors of the mask's size (128 MiB each); the
    blocks hold the boolean mask (16 MiB) and one block's int64 work. The same bits either way."""
    s, key = 4096, dropout_hash.stream_key(SEED, STEP, 7, int(DropoutSite.ATTENTION_PROBS))
    axes = [(3, 1, NH * s * s), (2, 1, s * s), (0, s, s), (0, s, 1)]  # sample 3, head 2 of NH
    blocks, blocks_peak = _peak_bytes(lambda: dropout_hash.keep_mask(P, key, axes, "cpu"))
    monkeypatch.setattr(dropout_hash, "BLOCK_ELEMENTS", s * s)  # one block: the single pass of before
    one_pass, one_pass_peak = _peak_bytes(lambda: dropout_hash.keep_mask(P, key, axes, "cpu"))
    assert torch.equal(blocks, one_pass)
    assert blocks_peak * 8 <= one_pass_peak, (blocks_peak, one_pass_peak)  # measured: 24 MiB against 512 MiB


def _draw(coords, layer=0, site=DropoutSite.ATTENTION_PROBS):
    """64 samples x 1024 x 16 mask elements, starting at the block's first sample."""
    return coords.keep_mask(P, layer, site, [(coords.first_sample_tensor, 64, 1024 * 16), (0, 1024, 16), (0, 16, 1)], "cpu")


def test_keep_rate_and_distinct_streams():
    with dropout_coordinates(SEED, STEP, 0) as coords:
        mask, other_layer, other_site = _draw(coords), _draw(coords, 1), _draw(coords, 0, DropoutSite.MLP_OUTPUT)
    # 2**20 Bernoulli(0.7) draws: standard deviation of the mean ~4.5e-4, so 3e-3 is > 6 sigma
    assert abs(mask.float().mean().item() - (1 - P)) < 3e-3
    with dropout_coordinates(SEED, STEP, 0) as coords:
        assert torch.equal(mask, _draw(coords))
    with dropout_coordinates(SEED, STEP, 1) as coords:  # the same samples, one row further on
        shifted = _draw(coords)
        assert torch.equal(shifted[:-1], mask[1:]) and not torch.equal(shifted, mask)
    for other in (other_layer, other_site):
        assert not torch.equal(mask, other)
    for seed, step in ((SEED, STEP + 1), (SEED + 1, STEP)):
        with dropout_coordinates(seed, step, 0) as coords:
            assert not torch.equal(mask, _draw(coords)), (seed, step)
    # not only unequal but uncorrelated: two streams agree on ~0.7^2 + 0.3^2 = 58% of the elements
    assert abs((mask == other_layer).float().mean().item() - 0.58) < 3e-3


def test_dropout_outside_the_coordinates_says_what_to_do():
    drop = build_hidden_dropout(P, "layout_invariant", False, None, 0, DropoutSite.EMBEDDING)
    with pytest.raises(RuntimeError, match="dropout_coordinates"):
        drop(torch.ones(S, B, H))
    drop.eval()
    assert torch.equal(drop(torch.ones(S, B, H)), torch.ones(S, B, H))  # no dropout outside training


def _dropped(sequence_parallel: bool, batch: int = B, first_sample: int = 0):
    """(attention probabilities after dropout [b, nh/p, s, s], hidden dropout of ones [s(/p), b, h]) on
    this rank. q = k = 0 makes every probability 1/s, v = I returns the dropped probabilities exactly."""
    cfg = pa.AttentionConfig(hidden_size=H, num_heads=NH, attention_dropout=P, causal=False,
                             dropout_rng="layout_invariant")
    attention = pa.ParallelSelfAttention(cfg, layer_number=2, sequence_parallel=sequence_parallel)
    nh_local = attention.num_heads_per_rank
    q = torch.zeros(batch, nh_local, S, S)
    v = torch.eye(S).expand(batch, nh_local, S, S)
    hidden = build_hidden_dropout(P, "layout_invariant", sequence_parallel, attention.tp_group, 1,
                                  DropoutSite.MLP_OUTPUT)
    s_local = S // attention.tp_size if sequence_parallel else S
    with dropout_coordinates(SEED, STEP, first_sample):
        return attention.core_attention(q, q, v, None, False), hidden(torch.ones(s_local, batch, H))


def _layout_worker():
    return {sp: _dropped(sp) for sp in (False, True)}


@pytest.mark.parametrize("world", [2, 4])
def test_masks_are_slices_of_the_single_rank_masks(world):
    attention_1, hidden_1 = _dropped(False)  # p = 1: needs no process group
    assert 0 < (attention_1 == 0).float().mean() < 2 * P and 0 < (hidden_1 == 0).float().mean() < 2 * P
    for rank, result in enumerate(run_distributed(_layout_worker, world)):
        heads = slice(rank * NH // world, (rank + 1) * NH // world)
        positions = slice(rank * S // world, (rank + 1) * S // world)
        for sp, (attention, hidden) in result.items():
            assert torch.equal(attention, attention_1[:, heads]), f"attention probs, rank {rank}, SP {sp}"
            assert torch.equal(hidden, hidden_1[positions] if sp else hidden_1), f"hidden, rank {rank}, SP {sp}"


def test_micro_batches_and_data_parallel_ranks_slice_the_global_batch():
    attention_1, hidden_1 = _dropped(False)
    for first in range(0, B, 2):  # two samples per micro-batch (or per data-parallel rank)
        attention, hidden = _dropped(False, batch=2, first_sample=first)
        assert torch.equal(attention, attention_1[first:first + 2])
        assert torch.equal(hidden, hidden_1[:, first:first + 2])


def _gradients(recompute: bool, backward_inside: bool) -> dict[str, torch.Tensor]:
    pa.manual_seed(0)
    cfg = pa.ModelConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, max_seq_len=S,
                         hidden_dropout=P, attention_dropout=P, dropout_rng="layout_invariant",
                         recompute_activations=recompute)
    model = pa.GPTModel(cfg)
    tokens = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(1))
    with dropout_coordinates(SEED, STEP, 0):
        loss = model(tokens, tokens)
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_recomputation_redraws_the_same_masks():
    plain = _gradients(False, True)
    # backward outside the block: recomputation replays the coordinates of the forward
    for recomputed in (_gradients(True, True), _gradients(True, False)):
        assert plain.keys() == recomputed.keys()
        for name, grad in plain.items():
            assert torch.equal(grad, recomputed[name]), name
    with pytest.raises(RuntimeError):
        current_dropout_coordinates()  # the block restored the state it found


# layouts of world <= 4 (world, tensor-parallel size, extra arguments); p1 is the reference
LAYOUTS = {"p1": (1, 1, []), "p2": (2, 2, []), "p4": (4, 4, []),
           "p2_sequence_parallel": (2, 2, ["--parallel.sequence_parallel=true"]), "p2_dp2": (4, 2, [])}


# The end-to-end run of the layout-invariant masks: CI's is tests/test_pretrain.py's layout test (p1 against p = 2 x
# dp = 2 with sequence parallelism, these masks on, 10 steps); the bar of 20 steps at every layout runs here
# with `pytest -m slow`.
@pytest.mark.slow
def test_pretraining_losses_with_dropout_do_not_depend_on_the_layout(shared_data, tmp_path):
    steps, losses = 20, {}
    for name, (world, tp, extra) in LAYOUTS.items():
        torchrun("pretrain.py", world, tiny_args(shared_data, tmp_path / name, tp, steps, *DROPOUT, *extra))
        losses[name] = train_losses(tmp_path / name)
    assert sorted(losses["p1"]) == list(range(1, steps + 1))
    for name, run in losses.items():
        for step, loss in losses["p1"].items():
            # float32: the layouts sum the same products in other orders; the masks themselves are identical
            assert run[step] == pytest.approx(loss, rel=1e-5), f"{name} step {step}"
