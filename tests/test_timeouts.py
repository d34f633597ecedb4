"""A rank that stops answering fails the others within the configured timeout, and the error
names the operation and the group (the groups inherit the world's timeout instead of torch's
30-minute default)."""

from __future__ import annotations

import time

import pytest
import torch

import parallel_attention as pa
from distributed import run_distributed
from parallel_attention.tensor_parallel.collectives import CollectiveTimeoutError, all_reduce

GROUP_TIMEOUT_S = 4


def _rank_0_times_out(wait) -> tuple[str, float] | None:
    """Rank 1 goes silent past the group's timeout; rank 0 runs `wait()`, which must raise CollectiveTimeoutError:
    (its message, the seconds it waited) on rank 0, None on rank 1."""
    if torch.distributed.get_rank() == 1:
        time.sleep(GROUP_TIMEOUT_S + 4)
        return None
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        wait()
    return str(info.value), time.monotonic() - started


def _silent_rank_worker(which: str):
    """Rank 1 never joins; rank 0 reports what its collective raised and how long it waited."""
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1 if which == "data" else 2, timeout=GROUP_TIMEOUT_S)
    group = pa.get_data_parallel_group() if which == "data" else pa.get_tensor_model_parallel_group()
    return _rank_0_times_out(lambda: all_reduce(torch.ones(4), group))


@pytest.mark.parametrize("which,name", [("tensor", "tensor-parallel group"), ("data", "data-parallel group")])
def test_a_silent_rank_times_out_with_the_group_and_operation_named(which, name):
    message, waited = run_distributed(_silent_rank_worker, 2, 2, which, timeout=60, fresh=True)[0]
    assert "all_reduce" in message and name in message and "global ranks [0, 1]" in message, message
    assert waited < GROUP_TIMEOUT_S + 3  # the group's timeout, not the world's (60 s) nor torch's 30 min


def _silent_rank_under_ddp_worker():
    """Both ranks build DDP (collective), then rank 1 goes silent; rank 0's backward waits on DDP's all-reduce."""
    from parallel_attention.training.data_parallel import data_parallel_step

    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1, timeout=GROUP_TIMEOUT_S)
    model, sync = data_parallel_step(torch.nn.Linear(4, 4), pa.get_data_parallel_group(), debug_collectives=False,
                                     zero_stage=0, pipelined=False)

    def step() -> None:
        with sync.forward(0, last=True):
            loss = model(torch.ones(2, 4)).sum()
        with sync.backward(0, last=True):
            loss.backward()

    return _rank_0_times_out(step)


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
    model(torch.ones(2, 4)).sum().backward()
    return _rank_0_times_out(optimizer.step)


def test_a_silent_rank_under_zero_times_out_naming_the_parameter_broadcast():
    message, waited = run_distributed(_silent_rank_under_zero_worker, 2, 2, timeout=60, fresh=True)[0]
    assert "ZeRO's parameter broadcast" in message and "data-parallel group" in message, message
    assert waited < GROUP_TIMEOUT_S + 3


class _Stack(torch.nn.Module):
    """What `shard_fully` shards: each of `layers`, then the root (which here also holds `head`)."""

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(num_layers))
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _silent_rank_under_fsdp2_worker(phase: str, guard: bool):
    """Both ranks shard a model with FSDP2 (zero_stage 3), then rank 1 goes silent before the forward (rank 0 waits
    in a parameter all-gather) or, for a root-only model that keeps its parameters gathered after the forward,
    before the backward (rank 0 waits in the gradient reduce-scatter). `guard`: under debug_collectives."""
    from parallel_attention.tensor_parallel import enable_collective_log
    from parallel_attention.training.fsdp import mesh_of, shard_fully

    pa.destroy_model_parallel()
    if guard:
        enable_collective_log()
    pa.initialize_model_parallel(1, timeout=GROUP_TIMEOUT_S)
    model = shard_fully(_Stack(2 if phase == "forward" else 0), mesh_of(pa.get_data_parallel_group()))
    if phase == "backward":
        loss = model(torch.ones(2, 4)).sum()
    return _rank_0_times_out(lambda: model(torch.ones(2, 4)) if phase == "forward" else loss.backward())


@pytest.mark.parametrize("phase,op,guard", [("forward", "FSDP2's parameter all_gather", False),
                                            ("backward", "FSDP2's gradient reduce_scatter", False),
                                            ("forward", "FSDP2's parameter all_gather", True)],
                         ids=["all_gather", "reduce_scatter", "all_gather_under_debug_collectives"])
def test_a_silent_rank_under_fsdp2_times_out_naming_the_operation_and_group(phase, op, guard):
    message, waited = run_distributed(_silent_rank_under_fsdp2_worker, 2, 2, phase, guard, timeout=60, fresh=True)[0]
    assert op in message and "data-parallel group (global ranks [0, 1])" in message, message
    if guard:  # debug_collectives records FSDP2's collectives: the timeout lists them among the rank's last calls
        assert "collective guard: the last" in message and f"{op} of float32" in message, message
    assert waited < GROUP_TIMEOUT_S + 3


def test_under_the_guard_nccl_is_initialised_with_blocking_wait_so_a_hang_raises_in_the_caller(monkeypatch):
    """No NCCL here: torch's CUDA calls and init_process_group are stood in for, to see the environment NCCL would
    read when the world group is created."""
    import os

    import torch.distributed as dist

    from parallel_attention.tensor_parallel.collective_log import disable_collective_log, enable_collective_log

    class Created(Exception):
        """init_process_group was reached; nothing further is needed."""

    seen = {}

    def init_process_group(backend, **kwargs):
        seen.update(backend=backend, blocking_wait=os.environ.get("TORCH_NCCL_BLOCKING_WAIT"),
                    device_id=kwargs.get("device_id"))
        raise Created

    clean = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NCCL")}
    monkeypatch.setattr(os, "environ", {**clean, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    for name, value in (("is_available", lambda: True), ("device_count", lambda: 1), ("set_device", lambda d: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    enable_collective_log()
    try:
        with pytest.raises(Created):
            pa.init_distributed(backend="nccl")
    finally:
        disable_collective_log()
    assert seen == {"backend": "nccl", "blocking_wait": "1", "device_id": torch.device("cuda", 0)}


def test_nccls_blocking_wait_timeout_is_named_with_the_operation_and_group():
    """What a blocking wait raises on NCCL (a DistBackendError; its words as ProcessGroupNCCL.cpp writes them)."""
    from parallel_attention.tensor_parallel.collectives import named_timeouts

    nccl = torch.distributed.DistBackendError(
        "[PG ID 2 PG GUID 3(tp) Rank 0] Work WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, "
        "Timeout(ms)=4000) timed out in blocking wait (TORCH_NCCL_BLOCKING_WAIT=1).")
    with pytest.raises(CollectiveTimeoutError, match=r"^all_reduce on the world group did not complete within"):
        with named_timeouts("all_reduce", None):
            raise nccl
