"""The autograd regions of tensor_parallel.mappings: values forward and backward, and counts.

Each rank feeds a rank-dependent input and a rank-dependent upstream gradient; the expected
values are built here from what every member of the group fed (the docstring's promise). All
values are small integers in float64, so every sum is exact whatever the reduction order:
results are compared with torch.equal. Collectives are counted by wrapping the torch.distributed
functions, and each call must issue exactly the documented ones on the group it was given.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from distributed import backend_for, device_params, local_device, run_distributed

import parallel_attention as pa
from parallel_attention.tensor_parallel import collectives, mappings

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA; the cpu variant runs the same checks"))]

# Every public name under which torch.distributed offers each kind of collective (old and new).
_COLLECTIVES = {
    "all_reduce": ["all_reduce", "all_reduce_coalesced"],
    "all_gather": ["all_gather_into_tensor", "all_gather_single", "all_gather", "_all_gather_base"],
    "reduce_scatter": ["reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter", "_reduce_scatter_base"],
    "other": ["broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
              "isend", "irecv", "barrier"],
}


@contextlib.contextmanager
def count_collectives(patch=None):
    """Yield a list that collects (kind, group) for each torch.distributed collective called."""
    calls: list[tuple[str, object]] = []
    originals = {}
    for kind, names in _COLLECTIVES.items():
        for name in names:
            original = getattr(dist, name, None)
            if original is None:
                continue

            def wrapper(*args, _original=original, _kind=kind, **kwargs):
                bound = inspect.signature(_original).bind(*args, **kwargs)
                calls.append((_kind, bound.arguments.get("group")))
                return _original(*args, **kwargs)

            originals[name] = original
            (patch or setattr)(dist, name, wrapper)
    try:
        yield calls
    finally:
        if patch is None:
            for name, original in originals.items():
                setattr(dist, name, original)


def _expect_calls(calls, expected: dict, group, what):
    assert Counter(kind for kind, _ in calls) == Counter(expected), f"{what}: collectives {calls}"
    assert all(g is group for _, g in calls), f"{what}: collective issued on another group"
    calls.clear()


def _value(global_rank, shape, scale, dev):
    """A rank-dependent integer-valued tensor."""
    n = torch.Size(shape).numel()
    return (torch.arange(n, dtype=torch.float64).view(shape) * scale + 100 * global_rank + 1).to(dev)


def _check_group(group, dev):
    members = dist.get_process_group_ranks(group)
    p, r, me = len(members), dist.get_rank(group), dist.get_rank()
    assert members[r] == me
    cat, total = torch.cat, sum
    # name: (fn, input, upstream gradient, expected output, expected input gradient,
    #        collectives forward, collectives backward)
    x = {g: _value(g, (2, 3, 5 * p), 1, dev) for g in members}       # split along the last dim
    d = {g: _value(g, (2, 3, 5), -2, dev) for g in members}          # its chunk's gradient
    xs = {g: _value(g, (2, 3, 5), 3, dev) for g in members}          # a sequence chunk [s/p, b, h]
    ds = {g: _value(g, (2 * p, 3, 5), -1, dev) for g in members}     # full-sequence gradient
    xf = {g: _value(g, (2 * p, 3, 5), 2, dev) for g in members}      # full-sequence partials
    cases = {
        "copy_to": (mappings.copy_to_tensor_parallel_region, x[me], x[me], x[me],
                    total(x[g] for g in members), {}, {"all_reduce": 1}),
        "reduce_from": (mappings.reduce_from_tensor_parallel_region, xs[me], xs[me],
                        total(xs[g] for g in members), xs[me], {"all_reduce": 1}, {}),
        "scatter_to": (mappings.scatter_to_tensor_parallel_region, x[me], d[me], x[me].chunk(p, -1)[r],
                       cat([d[g] for g in members], -1), {}, {"all_gather": 1}),
        "gather_from": (mappings.gather_from_tensor_parallel_region, d[me], x[me],
                        cat([d[g] for g in members], -1), x[me].chunk(p, -1)[r], {"all_gather": 1}, {}),
        "gather_from_sequence": (mappings.gather_from_sequence_parallel_region, xs[me], ds[me],
                                 cat([xs[g] for g in members], 0), total(ds[g] for g in members).chunk(p, 0)[r],
                                 {"all_gather": 1}, {"reduce_scatter": 1}),
        "reduce_scatter_to_sequence": (mappings.reduce_scatter_to_sequence_parallel_region, xf[me], xs[me],
                                       total(xf[g] for g in members).chunk(p, 0)[r], cat([xs[g] for g in members], 0),
                                       {"reduce_scatter": 1}, {"all_gather": 1}),
    }
    with count_collectives() as calls:
        for name, (fn, inp, up, out_expected, grad_expected, fwd, bwd) in cases.items():
            what = f"{name} p={p} rank={me}"
            inp = inp.clone().requires_grad_()
            out = fn(inp, group)
            _expect_calls(calls, fwd if p > 1 else {}, group, f"{what} forward")
            assert torch.equal(out, out_expected), f"{what}: forward value"
            if p == 1:
                assert out is inp, f"{what}: at p=1 the input must come back unchanged"
            (grad,) = torch.autograd.grad(out, inp, up.clone())
            _expect_calls(calls, bwd if p > 1 else {}, group, f"{what} backward")
            assert torch.equal(grad, grad_expected), f"{what}: backward value"
        for dim in (0, 1):
            shard = _value(me, (2, 3, 5), 1, dev).requires_grad_()
            full = collectives.all_gather_along_dim(shard, dim, group)
            _expect_calls(calls, {"all_gather": 1} if p > 1 else {}, group, f"all_gather_along_dim({dim})")
            assert torch.equal(full, cat([_value(g, (2, 3, 5), 1, dev) for g in members], dim))
            assert not full.requires_grad, "all_gather_along_dim is documented as outside autograd"
        for op, expected in [(dist.ReduceOp.SUM, total(xs[g] for g in members)),
                             (dist.ReduceOp.MAX, torch.stack([xs[g] for g in members]).amax(0))]:
            stat = xs[me].clone()
            assert collectives.all_reduce(stat, group, op) is stat, "all_reduce works in place"
            _expect_calls(calls, {"all_reduce": 1} if p > 1 else {}, group, f"all_reduce({op})")
            assert torch.equal(stat, expected), f"all_reduce({op}) p={p} rank={me}"


def _mappings_worker(kind):
    dev = local_device(kind)
    _check_group(pa.get_tensor_model_parallel_group(), dev)
    world = dist.get_world_size()
    if world == 4:  # also on sub-groups {0, 2}, {1, 3}, where group rank and global rank differ
        pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        _check_group(pairs[dist.get_rank() % 2], dev)
    return world


@pytest.mark.parametrize("world_size,device", device_params())
def test_collectives_values_and_counts(world_size, device):
    ranks = run_distributed(_mappings_worker, world_size, world_size, device, backend=backend_for(device))
    assert ranks == [world_size] * world_size


@pytest.mark.parametrize("device", DEVICES)
def test_no_group_is_identity_without_collectives(monkeypatch, device):
    """group=None (no torch.distributed, as in this pytest process): inputs come back, nothing is sent."""
    x = torch.randn(4, 3, 6, device=device, requires_grad=True)
    up = torch.randn(4, 3, 6, device=device)
    with count_collectives(monkeypatch.setattr) as calls:
        for fn in [mappings.copy_to_tensor_parallel_region, mappings.reduce_from_tensor_parallel_region,
                   mappings.scatter_to_tensor_parallel_region, mappings.gather_from_tensor_parallel_region,
                   mappings.gather_from_sequence_parallel_region, mappings.reduce_scatter_to_sequence_parallel_region]:
            out = fn(x, None)
            assert out is x
            assert torch.equal(torch.autograd.grad(out, x, up)[0], up)
        assert torch.equal(collectives.all_gather_along_dim(x, 1, None), x)
    assert calls == []


def _copy_to_grad_worker():
    """y + copy_to(x): the add hands one gradient tensor to both branches; copy_to's backward must
    all-reduce a copy of it, not the tensor itself, or y's gradient (and the caller's) changes too."""
    group, rank, p = pa.get_tensor_model_parallel_group(), dist.get_rank(), dist.get_world_size()
    mine = torch.full((2, 3), float(rank + 1), dtype=torch.float64)  # this rank's upstream gradient
    up = mine.clone()
    x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    y = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    grad_x, grad_y = torch.autograd.grad(y + mappings.copy_to_tensor_parallel_region(x, group), [x, y], up)
    summed = torch.full((2, 3), p * (p + 1) / 2, dtype=torch.float64)  # 1 + 2 + ... + p
    return {"grad_x": torch.equal(grad_x, summed), "grad_y": torch.equal(grad_y, mine),
            "upstream untouched": torch.equal(up, mine)}


def test_copy_to_backward_leaves_shared_gradient_alone():
    results = run_distributed(_copy_to_grad_worker, 2)
    assert results == [{"grad_x": True, "grad_y": True, "upstream untouched": True}] * 2
