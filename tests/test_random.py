"""Seeding: the default generator is the same on every rank, the tensor-parallel one differs per TP rank.

Each spawned rank draws from both generators and returns the draws; the comparisons across ranks
are made here. Equal draws are compared with torch.equal: a generator either reproduces its
stream exactly or it does not, so no tolerance applies.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import backend_for, local_device, run_distributed

import parallel_attention as pa
from parallel_attention.tensor_parallel import (
    get_tensor_parallel_rng_state,
    set_tensor_parallel_rng_state,
    tensor_parallel_rng,
)

PARAMS = [pytest.param(world, tp, kind, id=f"p{world}-tp{tp}-{kind}", marks=pytest.mark.skipif(
    kind == "cuda" and torch.cuda.device_count() < world, reason=f"needs {world} CUDA device(s) for NCCL; "
    "the cpu variant runs the same checks")) for world, tp in [(1, 1), (2, 2), (4, 2)] for kind in ("cpu", "cuda")]
SEED, N = 1234, 6


def _rand(dev):
    return torch.rand(N, device=dev, dtype=torch.float64)


def _random_worker(kind):
    dev = local_device(kind)
    # This process is fresh (spawned): nothing has seeded the tensor-parallel generator yet.
    with pytest.raises(RuntimeError, match="manual_seed"):
        with tensor_parallel_rng(dev):
            pass

    pa.manual_seed(SEED)
    default = _rand(dev)
    with tensor_parallel_rng(dev):
        tp = _rand(dev)
    after = _rand(dev)

    pa.manual_seed(SEED)  # the same seed repeats both streams ...
    assert torch.equal(_rand(dev), default)
    assert torch.equal(_rand(dev), after), "drawing inside tensor_parallel_rng advanced the default generator"
    with tensor_parallel_rng(dev):
        assert torch.equal(_rand(dev), tp), "the tensor-parallel stream does not repeat under the same seed"

    state = get_tensor_parallel_rng_state()  # ... and a saved state replays the draws that follow it
    with tensor_parallel_rng(dev):
        first = _rand(dev)
        assert not torch.equal(first, tp), "the tensor-parallel stream did not move on"
    with tensor_parallel_rng(dev):
        second = _rand(dev)
    set_tensor_parallel_rng_state(state)
    with tensor_parallel_rng(dev):
        assert torch.equal(_rand(dev), first) and torch.equal(_rand(dev), second)

    pa.manual_seed(SEED + 1)  # another seed, other streams
    other_default = _rand(dev)
    with tensor_parallel_rng(dev):
        other_tp = _rand(dev)
    assert not torch.equal(other_default, default) and not torch.equal(other_tp, tp)
    return {"tp_rank": pa.get_tensor_model_parallel_rank(), "default": default.cpu(), "tp": tp.cpu()}


@pytest.mark.parametrize("world_size,tp_size,device", PARAMS)
def test_default_stream_shared_tensor_parallel_stream_per_tp_rank(world_size, tp_size, device):
    results = run_distributed(_random_worker, world_size, tp_size, device, backend=backend_for(device))
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []):
        torch.manual_seed(SEED)  # manual_seed seeds the default generator exactly as torch does
        expected_default = torch.rand(N, device=device, dtype=torch.float64).cpu()
    assert [r["tp_rank"] for r in results] == [rank % tp_size for rank in range(world_size)]
    for i, a in enumerate(results):
        assert torch.equal(a["default"], expected_default), f"rank {i}: default stream differs"
        assert not torch.equal(a["tp"], a["default"]), f"rank {i}: tensor-parallel stream is the default one"
        for j, b in enumerate(results):
            # same TP rank (data-parallel replicas): same dropout; different TP rank: different dropout
            assert torch.equal(a["tp"], b["tp"]) == (a["tp_rank"] == b["tp_rank"]), f"ranks {i}, {j}"


@pytest.fixture
def restore_rng():
    """manual_seed changes module-global and default generator state: put both back."""
    saved = get_tensor_parallel_rng_state()
    with torch.random.fork_rng(devices=[]):
        yield
    set_tensor_parallel_rng_state(saved)


def test_single_rank_without_torch_distributed(restore_rng):
    assert not dist.is_initialized()
    pa.manual_seed(SEED)
    default = _rand("cpu")
    with tensor_parallel_rng("cpu"):
        tp = _rand("cpu")
    pa.manual_seed(SEED)
    assert torch.equal(_rand("cpu"), default)
    with tensor_parallel_rng("cpu"):
        assert torch.equal(_rand("cpu"), tp)
    assert not torch.equal(tp, default)


@pytest.mark.parametrize("seed", [-1, 2.5, "7"])
def test_bad_seed_is_rejected(seed, restore_rng):
    with pytest.raises(ValueError, match="seed"):
        pa.manual_seed(seed)
