"""Properties of ParallelSelfAttention across p: p-invariant weights, exact collective counts,
exact canonical round trips, dropout drawn from the tensor-parallel generator."""

from __future__ import annotations

import pytest
import torch

import parallel_attention as pa
from parallel_attention.check.collective_counter import count_collectives
from distributed import backend_for, device_params, local_device, run_distributed

GQA = dict(hidden_size=24, num_heads=8, num_kv_heads=2, head_dim=6, rotary=True)


def invariance_worker(device_kind):
    device = local_device(device_kind)
    pa.manual_seed(1234)
    module = pa.ParallelSelfAttention(pa.AttentionConfig(**GQA), device=device)
    initial = {k: v.cpu() for k, v in module.canonical_state_dict().items()}
    torch.manual_seed(5)
    x = torch.randn(6, 2, 24)
    out = module(x.to(device)).detach().cpu()
    # Round trip of arbitrary weights must be exact (pure slicing and gathering, no arithmetic).
    other = {k: torch.randn_like(v) for k, v in initial.items()}
    module.load_canonical_state_dict(other)
    round_trip = {k: v.cpu() for k, v in module.canonical_state_dict().items()}
    return initial, out, all(torch.equal(other[k], round_trip[k]) for k in other)


def test_canonical_weights_bit_identical_across_p():
    results = {p: run_distributed(invariance_worker, p, p, "cpu") for p in (1, 2, 4)}
    reference, ref_out, _ = results[1][0]
    for p, ranks in results.items():
        for rank, (weights, out, round_trip_exact) in enumerate(ranks):
            assert round_trip_exact, f"canonical round trip not exact at p={p} rank {rank}"
            assert weights.keys() == reference.keys()
            for name in reference:
                assert torch.equal(weights[name], reference[name]), f"{name} differs at p={p} rank {rank}"
            # float32 forward at p vs p = 1: only the summation order of the output projection differs
            torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)


def count_worker(device_kind, variants):
    """Collectives of construction, one forward, one backward and finalize_grads, per variant."""
    device = local_device(device_kind)
    p = pa.get_tensor_model_parallel_world_size()
    results = []
    for sequence_parallel, num_kv_heads in variants:
        cfg = pa.AttentionConfig(hidden_size=32, num_heads=4, num_kv_heads=num_kv_heads, rotary=True)
        with count_collectives() as construction:
            module = pa.ParallelSelfAttention(cfg, device=device, sequence_parallel=sequence_parallel)
        s_local = 8 // p if sequence_parallel else 8
        x = torch.randn(s_local, 2, 32, device=device, requires_grad=True)
        mask = torch.ones(2, 1, 1, 8, dtype=torch.bool, device=device)
        with count_collectives() as forward:
            out = module(x, attention_mask=mask)
        with count_collectives() as backward:
            out.sum().backward()
        with count_collectives() as finalize:
            pa.finalize_grads(module)
        results.append((dict(construction), dict(forward), dict(backward), dict(finalize)))
    return results


# (sequence_parallel, num_kv_heads): num_kv_heads=2 replicates k/v heads at p=4, which finalize_grads must sum
COUNT_VARIANTS = [(False, 4), (False, 2), (True, 4), (True, 2)]


@pytest.mark.parametrize("world_size,device", device_params())
def test_exact_collective_counts(world_size, device):
    per_rank = run_distributed(count_worker, world_size, world_size, device, COUNT_VARIANTS,
                               backend=backend_for(device))
    for results in per_rank:
        for (sequence_parallel, num_kv_heads), (construction, forward, backward, finalize) in zip(COUNT_VARIANTS,
                                                                                              results):
            where = f"p={world_size} sequence_parallel={sequence_parallel} num_kv_heads={num_kv_heads}"
            assert construction == {}, where
            if world_size == 1:
                assert forward == backward == finalize == {}, where
                continue
            expected = ({"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1} if sequence_parallel
                        else {"all_reduce": 1})
            assert forward == expected, f"forward at {where}"
            # SP: the query_key_value projection all-gathers its kept [s/p, b, h] input again (Korthikanti)
            regather = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 1}
            assert backward == (regather if sequence_parallel else expected), f"backward at {where}"
            needs_reduction = sequence_parallel or world_size > num_kv_heads
            assert finalize == ({"all_reduce": 1} if needs_reduction else {}), f"finalize at {where}"


def dropout_worker(draws):
    """All heads share one set of weights, so without dropout every rank's local context is the
    same; any difference across ranks then comes from the dropout masks alone."""
    torch.manual_seed(0)  # same weights and input on both ranks
    cfg = pa.AttentionConfig(hidden_size=16, num_heads=4, attention_dropout=0.5, causal=False)
    module = pa.ParallelSelfAttention(cfg)
    head = {n: torch.randn(4, 16) for n in ("q", "k", "v")}
    module.load_canonical_state_dict({
        "q_proj.weight": head["q"].repeat(4, 1), "k_proj.weight": head["k"].repeat(4, 1),
        "v_proj.weight": head["v"].repeat(4, 1), "o_proj.weight": torch.randn(16, 16),
        **{f"{n}.bias": torch.zeros(16) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}})
    contexts = []
    module.dense.register_forward_pre_hook(lambda _, args: contexts.append(args[0].detach().clone()))
    x = torch.randn(5, 2, 16)

    def run(seed):
        pa.manual_seed(seed)
        module(x)
        return contexts[-1], torch.rand(3)

    first, default_after = run(11)
    repeat, _ = run(11)
    torch.manual_seed(11)
    default_untouched = torch.rand(3)
    for _ in range(draws):
        module(x)
    samples = torch.stack(contexts[-draws:])
    module.eval()
    module(x)
    expectation = contexts[-1]
    return dict(first=first, repeat=repeat, default_after=default_after, default_untouched=default_untouched,
                mean=samples.mean(0), expectation=expectation)


def test_dropout_masks_per_rank_repeatable_and_unbiased():
    r0, r1 = run_distributed(dropout_worker, 2, 2, 400)
    assert torch.equal(r0["first"], r0["repeat"]) and torch.equal(r1["first"], r1["repeat"]), "not repeatable"
    assert torch.equal(r0["expectation"], r1["expectation"]), "heads not identical: the test is not set up right"
    assert not torch.equal(r0["first"], r1["first"]), "dropout masks equal across tensor-parallel ranks"
    # Dropout inside the region draws from the tensor-parallel generator, not the default one.
    assert torch.equal(r0["default_after"], r0["default_untouched"])
    for r in (r0, r1):
        # Mean of 400 inverted-dropout samples: per-element std of the mean is about
        # |context| / sqrt(400) = 5% of its scale; 0.25 of the largest magnitude is ~5 sigma.
        scale = r["expectation"].abs().max()
        assert (r["mean"] - r["expectation"]).abs().max() < 0.25 * scale
        assert (r["first"] - r["expectation"]).abs().max() > 0.05 * scale  # dropout really acted


@pytest.mark.parametrize("rotary", [False, True])
def test_the_projection_saves_no_extra_buffer(rotary):
    """Without rotary q, k, v [b, heads, s, d] are views of one fused buffer of exactly their size; with rotary, v
    is a copy of its own, so that nothing the kernel saves keeps the fused buffer alive (the module docstring's
    memory claim). The CPU kernel's batch-major copy: test_causal_chunks."""
    config = pa.AttentionConfig(**{**GQA, "rotary": rotary})
    module = pa.ParallelSelfAttention(config)
    s, b = 5, 3
    q, k, v = module._project(torch.randn(s, b, 24), s, None, 0)
    fused_bytes = (8 + 2 * 2) * 6 * s * b * 4
    if rotary:
        assert v.untyped_storage().nbytes() == v.numel() * 4
    else:
        assert {t.untyped_storage().data_ptr() for t in (q, k, v)} == {q.untyped_storage().data_ptr()}
        assert q.untyped_storage().nbytes() == fused_bytes
