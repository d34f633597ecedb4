"""The parallel linears' autograd functions (tensor_parallel/linear_functions.py), every variant.

A column -> GELU -> row block (the shape of the MLP and, without the GELU, of attention) at p = 2 and 4, with
and without sequence parallelism, overlap_comm on and off, against a float64 single-device reference written
here: output, input gradient and every weight gradient. Collectives are counted forward and backward apart:
overlap changes none of them; under SP the column all-gathers its kept [s/p, b, h] input again in backward
(Korthikanti et al. 2022), which keeps only that chunk for backward. The async path still runs through the
collective guard and the timeout naming. Sizes are awkward (s 12, b 3, h 10, f 20) so that a mis-sliced
dimension cannot pass. The p = 2 cases share one pool of ranks (the guard's case last: it leaves the guard on).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from rank_pool import RankPool

import parallel_attention as pa
from parallel_attention.check.collective_counter import count_collectives
from parallel_attention.tensor_parallel.linear_functions import local_linear
from parallel_attention.tensor_parallel import CollectiveMismatchError, enable_collective_log
from parallel_attention.tensor_parallel.collectives import CollectiveTimeoutError, all_reduce
from parallel_attention.tensor_parallel.mappings import (copy_to_tensor_parallel_region,
                                                         reduce_from_tensor_parallel_region)

S, B, H, FFN = 12, 3, 10, 20
# float64: the sharded block sums the same products as the reference in another order (per-rank partial
# sums, then the collective): a few ulps of values of order 1-10, far below 1e-10
TOL = dict(rtol=1e-10, atol=1e-10)


def _data(dtype=torch.float64):
    g = torch.Generator().manual_seed(11)
    shapes = {"x": (S, B, H), "dy": (S, B, H), "w1": (FFN, H), "b1": (FFN,), "w2": (H, FFN), "b2": (H,)}
    return {name: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype) for name, shape in shapes.items()}


def _reference(d):
    """Output and gradients (x, w1, b1, w2, b2) of the unsharded block."""
    leaves = {k: d[k].clone().requires_grad_() for k in ("x", "w1", "b1", "w2", "b2")}
    y = F.linear(F.gelu(F.linear(leaves["x"], leaves["w1"], leaves["b1"])), leaves["w2"], leaves["b2"])
    y.backward(d["dy"])
    return y.detach(), {k: v.grad for k, v in leaves.items()}


def _block(d, sp: bool, overlap: bool, dtype=torch.float64):
    p, r = dist.get_world_size(), dist.get_rank()
    col = pa.ColumnParallelLinear(H, FFN, sequence_parallel=sp, overlap_comm=overlap, init_std=None, dtype=dtype)
    row = pa.RowParallelLinear(FFN, H, input_is_parallel=True, sequence_parallel=sp, init_std=None, dtype=dtype)
    with torch.no_grad():
        col.weight.copy_(d["w1"].chunk(p, 0)[r])
        col.bias.copy_(d["b1"].chunk(p, 0)[r])
        row.weight.copy_(d["w2"].chunk(p, 1)[r])
        row.bias.copy_(d["b2"])
    return col, row


def _run_block(d, sp, overlap):
    """Output, gradients and the collectives of forward and backward, on this rank."""
    p, r = dist.get_world_size(), dist.get_rank()
    col, row = _block(d, sp, overlap)
    x = (d["x"].chunk(p, 0)[r] if sp else d["x"]).clone().requires_grad_()
    with count_collectives() as forward:
        y = row(F.gelu(col(x)))
    with count_collectives() as backward:
        y.backward(d["dy"].chunk(p, 0)[r] if sp else d["dy"])
    grads = {"x": x.grad, "w1": col.weight.grad, "b1": col.bias.grad, "w2": row.weight.grad, "b2": row.bias.grad}
    return y.detach(), grads, dict(forward), dict(backward)


def _expected_counts(sp: bool):
    if sp:  # forward: the column's all-gather, the row's reduce-scatter; backward: the row's all-gather of dY,
        # the column's all-gather of its kept input and its reduce-scatter of dX
        return {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}, \
            {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 1}
    return {"all_reduce": 1}, {"all_reduce": 1}


def _equivalence_worker():
    p, r = dist.get_world_size(), dist.get_rank()
    d = _data()
    y_ref, g_ref = _reference(d)
    for sp in (False, True):
        results = {}
        for overlap in (True, False):
            y, grads, fwd, bwd = results[overlap] = _run_block(d, sp, overlap)
            tag = f"p={p} sp={sp} overlap={overlap}"
            torch.testing.assert_close(y, y_ref.chunk(p, 0)[r] if sp else y_ref, **TOL, msg=f"{tag}: output")
            expected = {"x": g_ref["x"].chunk(p, 0)[r] if sp else g_ref["x"], "w1": g_ref["w1"].chunk(p, 0)[r],
                        "b1": g_ref["b1"].chunk(p, 0)[r], "w2": g_ref["w2"].chunk(p, 1)[r], "b2": g_ref["b2"]}
            if sp:  # b2's gradient is partial (this rank's tokens): finalize_grads' sum, outside the counts
                grads["b2"] = all_reduce(grads["b2"].clone(), pa.get_tensor_model_parallel_group())
            for name, value in grads.items():
                torch.testing.assert_close(value, expected[name], **TOL, msg=f"{tag}: grad {name}")
            assert (fwd, bwd) == _expected_counts(sp), (tag, fwd, bwd)
        on, off = results[True], results[False]  # overlap reorders the backward, not its arithmetic: bit-identical
        assert torch.equal(on[0], off[0]) and all(torch.equal(on[1][k], off[1][k]) for k in on[1]), sp
    return True


def _kept_for_backward_worker():
    """What each SP column keeps for backward is its [s/p, b, h] input, not the gathered [s, b, h]."""
    p, r = dist.get_world_size(), dist.get_rank()
    d = _data()
    col, _ = _block(d, True, True)
    x = d["x"].chunk(p, 0)[r].clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        col(x)
    return saved


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(2, timeout=180)
    yield ranks
    ranks.close()


def test_every_variant_matches_the_reference_with_the_same_collectives(pool):
    assert pool.run(_equivalence_worker) == [True, True]


def test_every_variant_at_p4():
    assert run_distributed(_equivalence_worker, 4, 4, timeout=180) == [True] * 4


def test_the_sequence_parallel_column_keeps_only_its_chunk(pool):
    for saved in pool.run(_kept_for_backward_worker):
        assert saved == [(S // 2, B, H), (FFN // 2, H)], saved  # the local input and the weight shard


def _public_regions(d, x):
    """The block through the public region functions (a defensive clone on each all-reduce), float32, on the
    layers' own GEMM (`local_linear`)."""
    group, p, r = pa.get_tensor_model_parallel_group(), dist.get_world_size(), dist.get_rank()
    w1 = d["w1"].chunk(p, 0)[r].clone().requires_grad_()
    w2 = d["w2"].chunk(p, 1)[r].clone().requires_grad_()
    hidden = F.gelu(local_linear(copy_to_tensor_parallel_region(x, group), w1, d["b1"].chunk(p, 0)[r]))
    return reduce_from_tensor_parallel_region(local_linear(hidden, w2), group) + d["b2"], (w1, w2)


def _no_clone_worker():
    """The layers reduce their own fresh GEMM outputs in place; the public regions reduce a clone:
    the numbers must be the same, bit for bit (float32, where a changed order of operations would show)."""
    d = _data(torch.float32)
    x_regions = d["x"].clone().requires_grad_()
    y_regions, (w1, w2) = _public_regions(d, x_regions)
    y_regions.backward(d["dy"])
    col, row = _block(d, False, True, torch.float32)
    x = d["x"].clone().requires_grad_()
    y = row(F.gelu(col(x)))
    y.backward(d["dy"])
    pairs = {"output": (y, y_regions), "x": (x.grad, x_regions.grad), "w1": (col.weight.grad, w1.grad),
             "w2": (row.weight.grad, w2.grad)}
    return {name: (a - b).abs().max().item() for name, (a, b) in pairs.items()}


def test_in_place_reductions_change_no_number(pool):
    for differences in pool.run(_no_clone_worker):
        assert differences == {"output": 0.0, "x": 0.0, "w1": 0.0, "w2": 0.0}, differences


def _autocast_worker():
    """CPU autocast (bfloat16): gradients come back in the parameters' and the input's dtype (float32),
    equal to the public-region path, which autocast casts itself."""
    d = _data(torch.float32)
    results = []
    for build in ("regions", "layers"):
        x = d["x"].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if build == "regions":
                y, (w1, w2) = _public_regions(d, x)
            else:
                col, row = _block(d, False, True, torch.float32)
                y, (w1, w2) = row(F.gelu(col(x))), (col.weight, row.weight)
        y.float().backward(d["dy"])
        results.append([t.float() for t in (y, x.grad, w1.grad, w2.grad)] + [x.grad.dtype, w1.grad.dtype])
    (*ref, _, _), (*got, x_dtype, w_dtype) = results
    assert x_dtype == w_dtype == torch.float32
    for a, b in zip(got, ref):  # bfloat16 GEMMs (8 bits of mantissa)
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
    return True


def test_autocast_gradients_keep_their_dtypes(pool):
    assert pool.run(_autocast_worker) == [True, True]


def _guard_worker():
    d = _data()
    before = _run_block(d, False, True)[:2]
    enable_collective_log()
    after = _run_block(d, False, True)[:2]  # guarded: recorded and cross-checked, same numbers
    assert torch.equal(before[0], after[0]) and all(torch.equal(before[1][k], after[1][k]) for k in before[1])
    col, _ = _block(d, False, True)
    try:
        if dist.get_rank() == 0:  # the async all-reduce of dX against another rank's different call
            col(d["x"].clone().requires_grad_()).sum().backward()
        else:
            all_reduce(torch.ones(4, dtype=torch.float64), pa.get_tensor_model_parallel_group())
    except CollectiveMismatchError as error:
        return str(error)
    return None


def test_the_guard_checks_the_async_collective(pool):
    messages = pool.run(_guard_worker)
    assert messages[0] is not None and messages[0] == messages[1], messages
    # the third guarded call of each rank: the guarded block's forward and backward came first
    assert f"rank 0: #3 all_reduce of float64[{S}, {B}, {H}] on the tensor-parallel group" in messages[0], messages[0]
    assert "tensor_parallel/linear_functions.py" in messages[0] and "rank 1: #3 all_reduce of float64[4]" in messages[0]


GROUP_TIMEOUT_S = 4


def _timeout_worker():
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(2, timeout=GROUP_TIMEOUT_S)
    d = _data()
    col, _ = _block(d, False, True)
    y = col(d["x"].clone().requires_grad_())
    if dist.get_rank() == 1:  # stops answering
        time.sleep(GROUP_TIMEOUT_S + 4)
        return None
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        y.sum().backward()  # the async all-reduce of dX; its wait() raises
    return str(info.value), time.monotonic() - started


def test_a_timeout_in_the_async_wait_is_named():
    # fresh ranks: the worker makes 4 s groups and a timed-out gloo pair stays closed, which a reset cannot undo
    message, waited = run_distributed(_timeout_worker, 2, 2, timeout=60, fresh=True)[0]
    assert "all_reduce on the tensor-parallel group (global ranks [0, 1]) did not complete" in message, message
    assert waited < GROUP_TIMEOUT_S + 3
