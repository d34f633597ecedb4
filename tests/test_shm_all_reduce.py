"""The opt-in shared-memory all-reduce (tensor_parallel/shm_all_reduce.py, PARALLEL_ATTENTION_SHM_ALL_REDUCE=1).

Every rank must hold bitwise the same sum, equal to a float64 reference within float32 rounding (bitwise gloo's
at two ranks, where a + b is the only order), for tensors larger than a slot too. The column -> row block of
test_overlap gives the same output and gradients with it and without it, with the same collective counts.
The handshake keeps gloo everywhere if one rank cannot map the buffer and leaves no file behind; a rank that
goes silent fails the other within the group's timeout, named; without the variable gloo runs.
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_overlap import _block, _data, _reference, _run_block

import parallel_attention as pa
from parallel_attention.tensor_parallel import shm_all_reduce as shm
from parallel_attention.tensor_parallel.collectives import CollectiveTimeoutError, _all_reduce, all_reduce_

pytestmark = pytest.mark.skipif(not shm.machine_supported(), reason="the shared-memory all-reduce is x86-64 only")

# (shape, dtype): a TP activation, more elements than a 4 MiB slot holds (five chunks), odd small tensors
CASES = [((64, 2, 96), torch.float32), ((5 * shm.SLOT_BYTES // 4 + 3,), torch.float32), ((7,), torch.float64),
         ((3, 5), torch.int64), ((4, 3), torch.bfloat16)]


@contextlib.contextmanager
def _requested(value: str = "1"):
    saved = os.environ.get(shm.ENV)
    os.environ[shm.ENV] = value
    try:
        yield
    finally:
        os.environ.pop(shm.ENV) if saved is None else os.environ.__setitem__(shm.ENV, saved)


def _inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(shape, generator=g, dtype=torch.float64) * 8).to(dtype) for shape, dtype in CASES]


def _sums_worker():
    group = pa.get_tensor_model_parallel_group()
    with _requested():
        ours = [all_reduce_(x, group) for x in _inputs(dist.get_rank())]
        shared = shm.lookup(group)[1] is not None
    gloo = [all_reduce_(x, group) for x in _inputs(dist.get_rank())]
    leftovers = [name for name in os.listdir("/dev/shm") if name.startswith("parallel_attention_")]
    return ours, gloo, shared, leftovers


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_holds_the_same_sum_as_the_reference(world):
    results = run_distributed(_sums_worker, world, world)
    reference = [sum(_inputs(rank)[i].double() for rank in range(world)) for i in range(len(CASES))]
    for ours, gloo, shared, leftovers in results:
        assert shared and not leftovers
        for i, ((shape, dtype), want) in enumerate(zip(CASES, reference)):
            assert torch.equal(ours[i], results[0][0][i]), f"ranks disagree on {shape} {dtype}"
            assert ours[i].shape == shape and ours[i].dtype == dtype
            tol = {torch.bfloat16: 0.25, torch.float32: 1e-4}.get(dtype, 1e-12)  # bf16: 8 bits of 8 * 4 = 32
            torch.testing.assert_close(ours[i].double(), want, rtol=0, atol=tol)
            if world == 2:
                assert torch.equal(ours[i], gloo[i])


def _block_worker(chunks):
    d = _data(torch.float64)
    with _requested():
        ours = _run_block(d, sp=False, overlap=True, chunks=chunks)
    return ours, _run_block(d, sp=False, overlap=True, chunks=chunks), _reference(d)


@pytest.mark.parametrize("chunks", [1, 3])  # 3: three sums in flight at once (a third post finishes the first)
def test_the_parallel_block_is_unchanged_and_counts_the_same_collectives(chunks):
    for (y, grads, forward, backward), (y_gloo, grads_gloo, forward_gloo, backward_gloo), (y_ref, grads_ref) in \
            run_distributed(_block_worker, 2, 2, chunks):
        assert torch.equal(y, y_gloo) and all(torch.equal(grads[k], grads_gloo[k]) for k in grads)
        torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
        assert forward == forward_gloo == {"all_reduce": chunks} and backward == backward_gloo == {"all_reduce": 1}


def _compiled_block_worker():
    """The column -> row block compiled with inductor, the shared-memory sums between its graphs."""
    d = _data(torch.float64)
    with _requested():
        all_reduce_(torch.ones(1), pa.get_tensor_model_parallel_group())  # the handshake, eager as in training
        col, row = _block(d, sp=False, overlap=True, chunks=1)
        block = torch.compile(lambda t: row(torch.nn.functional.gelu(col(t))), backend="inductor")
        for _ in range(3):  # the buffer's call number changes with every call: dynamo would recompile on it
            col.zero_grad(), row.zero_grad()
            x = d["x"].clone().requires_grad_()
            time.sleep(0.3 * dist.get_rank())  # rank 1 posts late: rank 0's sum must wait for its part
            y = block(x)
            y.backward(d["dy"])
        buffer = shm.lookup(pa.get_tensor_model_parallel_group())[1]
    grads = {"x": x.grad, "w1": col.weight.grad, "b1": col.bias.grad, "w2": row.weight.grad, "b2": row.bias.grad}
    return dist.get_rank(), y.detach(), grads, buffer._posted if buffer is not None else None, _reference(d)


def test_a_compiled_block_sums_through_shared_memory_like_eager():
    """torch.compile must not trace into the shared-memory sum (dynamo would run its buffer copies on fake
    tensors of symbolic size and fail): it runs eagerly between the compiled pieces, with the same results."""
    for rank, y, grads, posted, (y_ref, grads_ref) in run_distributed(_compiled_block_worker, 2, 2, fresh=True):
        assert posted == 1 + 3 * 2  # the handshake's sum, then each step's forward and backward sum: none via gloo
        shards = {"w1": grads_ref["w1"].chunk(2, 0)[rank], "b1": grads_ref["b1"].chunk(2, 0)[rank],
                  "w2": grads_ref["w2"].chunk(2, 1)[rank]}
        for ours, want in [(y, y_ref)] + [(grads[k], shards.get(k, grads_ref[k])) for k in grads]:
            torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-10)


def _async_worker():
    """Three async sums in flight (one of five chunks), a gloo MAX between post and wait, ranks out of step."""
    group, rank = pa.get_tensor_model_parallel_group(), dist.get_rank()
    xs = _inputs(rank)[:3]
    with _requested():
        all_reduce_(torch.ones(1), group)  # the handshake
        time.sleep(0.2 * rank)  # the later ranks post late: the early ones wait at the first wait(), not the post
        pending = [_all_reduce(x, group, async_op=True) for x in xs]
        top = all_reduce_(torch.tensor([float(rank)]), group, dist.ReduceOp.MAX)
        sums = [p.wait() for p in reversed(pending)][::-1]  # waiting for the last finishes the others, in order
    return sums, top.item()


@pytest.mark.parametrize("world", [2, 4])
def test_async_sums_finish_in_order_beside_other_collectives(world):
    results = run_distributed(_async_worker, world, world)
    reference = [sum(_inputs(rank)[i].double() for rank in range(world)) for i in range(3)]
    for sums, top in results:
        assert top == world - 1
        for ours, first, want in zip(sums, results[0][0], reference):
            assert torch.equal(ours, first)
            torch.testing.assert_close(ours.double(), want, rtol=0, atol=1e-4 if ours.dtype == torch.float32 else 0)


def _one_rank_cannot_map_worker():
    if dist.get_rank() == 1:
        shm.attach = lambda *args: None  # as on another host: the buffer file is not there
    group = pa.get_tensor_model_parallel_group()
    with _requested():
        total = all_reduce_(torch.full((4,), float(dist.get_rank() + 1)), group)
    set_up, buffer = shm.lookup(group)
    return total.tolist(), set_up, buffer is None


def test_the_group_keeps_gloo_when_a_rank_cannot_map_the_buffer():
    for total, set_up, kept_gloo in run_distributed(_one_rank_cannot_map_worker, 2, 2, fresh=True):
        assert total == [3.0] * 4 and set_up and kept_gloo


def _silent_rank_worker():
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(2, timeout=3)
    group = pa.get_tensor_model_parallel_group()
    with _requested():
        all_reduce_(torch.ones(4), group)  # the handshake, on both ranks
        if dist.get_rank() == 1:
            time.sleep(7)
            return None
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            all_reduce_(torch.ones(4), group)
    return str(info.value), time.monotonic() - started


def test_a_silent_rank_times_out_with_the_operation_and_group_named():
    message, waited = run_distributed(_silent_rank_worker, 2, 2, timeout=60, fresh=True)[0]
    assert "all_reduce" in message and "tensor-parallel group" in message and "shared-memory" in message, message
    assert waited < 3 + 2


def _not_requested_worker():
    group, calls, real = pa.get_tensor_model_parallel_group(), [], dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
    try:
        with _requested("0"):
            total = all_reduce_(torch.ones(4), group)
    finally:
        dist.all_reduce = real
    return total.tolist(), len(calls), pa.active_paths()["sum all-reduce (gloo groups on one host)"]


def test_without_the_variable_gloo_runs():
    for total, gloo_calls, path in run_distributed(_not_requested_worker, 2, 2):
        assert total == [2.0] * 4 and gloo_calls == 1 and path.startswith("gloo's")
