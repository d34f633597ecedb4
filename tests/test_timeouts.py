"""A rank that stops answering fails the others within the configured timeout, and the error
names the operation and the group (the groups inherit the world's timeout instead of torch's
30-minute default)."""

from __future__ import annotations

import time

import pytest
import torch

import parallel_attention as pa
from distributed import run_distributed
from parallel_attention.tensor_parallel.collectives import CollectiveTimeoutError, all_reduce_

GROUP_TIMEOUT_S = 4


def _silent_rank_worker(which: str):
    """Rank 1 never joins; rank 0 reports what its collective raised and how long it waited."""
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1 if which == "data" else 2, timeout=GROUP_TIMEOUT_S)
    if torch.distributed.get_rank() == 1:
        time.sleep(GROUP_TIMEOUT_S + 4)
        return None
    group = pa.get_data_parallel_group() if which == "data" else pa.get_tensor_model_parallel_group()
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        all_reduce_(torch.ones(4), group)
    return str(info.value), time.monotonic() - started


@pytest.mark.parametrize("which,name", [("tensor", "tensor-parallel group"), ("data", "data-parallel group")])
def test_a_silent_rank_times_out_with_the_group_and_operation_named(which, name):
    message, waited = run_distributed(_silent_rank_worker, 2, 2, which, timeout=60, fresh=True)[0]
    assert "all_reduce" in message and name in message and "global ranks [0, 1]" in message, message
    assert waited < GROUP_TIMEOUT_S + 3  # the group's timeout, not the world's (60 s) nor torch's 30 min


def _silent_rank_under_ddp_worker():
    """Both ranks build DDP (collective), then rank 1 goes silent; rank 0's backward waits on DDP's all-reduce."""
    from parallel_attention.training.data_parallel import reduce_gradients, wrap_data_parallel

    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1, timeout=GROUP_TIMEOUT_S)
    model = wrap_data_parallel(torch.nn.Linear(4, 4), pa.get_data_parallel_group())
    if torch.distributed.get_rank() == 1:
        time.sleep(GROUP_TIMEOUT_S + 4)
        return None
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        with reduce_gradients(model, reduce=True):
            model(torch.ones(2, 4)).sum().backward()
    return str(info.value), time.monotonic() - started


def test_a_silent_rank_under_ddp_times_out_naming_the_gradient_all_reduce():
    message, waited = run_distributed(_silent_rank_under_ddp_worker, 2, 2, timeout=60, fresh=True)[0]
    assert "DDP's gradient all-reduce" in message and "data-parallel group" in message, message
    assert waited < GROUP_TIMEOUT_S + 3


def _silent_rank_under_zero_worker():
    """Both ranks build the sharded AdamW, then rank 1 goes silent; rank 0's step waits on the broadcast of the
    parameters rank 1 owns."""
    from parallel_attention.training.sharded_optimizer import sharded_adamw

    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1, timeout=GROUP_TIMEOUT_S)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    optimizer = sharded_adamw([{"params": list(model.parameters())}], pa.get_data_parallel_group(), lr=0.1)
    if torch.distributed.get_rank() == 1:
        time.sleep(GROUP_TIMEOUT_S + 4)
        return None
    model(torch.ones(2, 4)).sum().backward()
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        optimizer.step()
    return str(info.value), time.monotonic() - started


def test_a_silent_rank_under_zero_times_out_naming_the_parameter_broadcast():
    message, waited = run_distributed(_silent_rank_under_zero_worker, 2, 2, timeout=60, fresh=True)[0]
    assert "ZeRO's parameter broadcast" in message and "data-parallel group" in message, message
    assert waited < GROUP_TIMEOUT_S + 3
