"""The collective guard (`parallel.debug_collectives`): ranks that issue different collectives stop at the first
diverging call, each rank's call named with its call site; a timeout lists the calls that led to it; and the
guard changes no number of a training run."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

import parallel_attention as pa
from distributed import run_distributed
from launch import ROOT, environment, run_command, torchrun_command, train_losses
from parallel_attention.tensor_parallel import CollectiveMismatchError, enable_collective_log
from parallel_attention.tensor_parallel.collectives import (CollectiveTimeoutError, all_gather_along_dim, all_reduce,
                                                            broadcast_object)
from test_pretrain import data_dir, tiny_args  # noqa: F401  (data_dir is a fixture)


def _rank0_sums(group):
    all_reduce(torch.ones(4), group)


def _rank1_gathers(group):
    all_gather_along_dim(torch.ones(2, 3), 0, group)


def _mismatch_worker():
    enable_collective_log()
    group = pa.get_tensor_model_parallel_group()
    all_reduce(torch.ones(3), group)  # agreed: part of the history
    broadcast_object("agreed too")
    try:
        (_rank0_sums if dist.get_rank() == 0 else _rank1_gathers)(group)
    except CollectiveMismatchError as error:
        return str(error)
    return None


def test_mismatched_collectives_name_each_ranks_first_diverging_call():
    messages = run_distributed(_mismatch_worker, 2, 2, timeout=90, fresh=True)
    assert messages[0] is not None and messages[0] == messages[1], messages  # every rank stops, with one story
    message = messages[0]
    assert "tensor-parallel group (global ranks [0, 1]) issued different collectives" in message, message
    assert "rank 0: #3 all_reduce of float32[4] on the tensor-parallel group" in message, message
    assert "rank 1: #3 all_gather of float32[2, 3] on the tensor-parallel group" in message, message
    for site in (_rank0_sums, _rank1_gathers):  # the line of the call inside each
        assert f"tests/test_collective_guard.py:{site.__code__.co_firstlineno + 1} in {site.__name__}" in message
    assert re.search(r"before it, rank 1: #1 all_reduce at tests/test_collective_guard\.py:\d+ in _mismatch_worker; "
                     r"#2 broadcast_object at tests/test_collective_guard\.py:\d+ in _mismatch_worker", message), message


GROUP_TIMEOUT_S = 4


def _rank0_waits(group):
    all_reduce(torch.ones(2), group)


def _timeout_worker():
    enable_collective_log()  # before the groups: torch's DETAIL checks wrap them too
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(2, timeout=GROUP_TIMEOUT_S)
    group = pa.get_tensor_model_parallel_group()
    all_reduce(torch.ones(5), group)
    if dist.get_rank() == 1:  # stops answering
        time.sleep(GROUP_TIMEOUT_S + 4)
        return None
    with pytest.raises(CollectiveTimeoutError) as info:
        _rank0_waits(group)
    return str(info.value)


def test_a_timeout_under_the_guard_lists_the_recent_calls():
    message = run_distributed(_timeout_worker, 2, 2, timeout=90, fresh=True)[0]
    assert "all_reduce on the tensor-parallel group (global ranks [0, 1]) did not complete" in message, message
    assert "the last 2 collectives of rank 0, oldest first" in message, message
    assert "#1 all_reduce of float32[5]" in message and "in _timeout_worker" in message, message
    assert "#2 all_reduce of float32[2] on the tensor-parallel group" in message and "in _rank0_waits" in message


def _group_names():
    from parallel_attention.tensor_parallel import parallel_state as ps

    return ps.describe_group(None), ps.describe_group(ps.get_data_parallel_group())


def test_a_world_collective_at_pp_1_and_tp_1_is_named_the_world_group():
    """At pp 1 (no embedding group) and tp 1 (no tensor-parallel group) the absent groups are None: a collective
    of the whole job must not be labelled with their names."""
    world, data = run_distributed(_group_names, 2, 1)[0]
    assert world == "world group" and data == "data-parallel group (global ranks [0, 1])"


# runs pretrain.py and reports how many collectives the guard recorded on each rank
WRAPPER = """import runpy, sys
sys.argv = [{script!r}] + sys.argv[1:]
try:
    runpy.run_path({script!r}, run_name="__main__")
finally:
    from parallel_attention.tensor_parallel.collective_log import active_log
    log = active_log()
    print("guarded collectives:", log.calls[-1].number if log and log.calls else 0, file=sys.stderr)
"""


@pytest.mark.slow  # CI keeps the mismatch and timeout tests of the guard
def test_the_guard_changes_no_loss(data_dir, tmp_path):  # noqa: F811
    wrapper = tmp_path / "pretrain_counting.py"
    wrapper.write_text(WRAPPER.format(script=str(ROOT / "scripts" / "pretrain.py")))
    losses, recorded = {}, {}
    for guard in ("false", "true"):
        run = tmp_path / f"guard_{guard}"
        command = torchrun_command("pretrain.py", 2, tiny_args(data_dir, run, 2, 3,
                                                            f"--parallel.debug_collectives={guard}"))
        command[command.index(str(ROOT / "scripts" / "pretrain.py"))] = str(wrapper)
        result = run_command(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-4000:]
        losses[guard] = train_losses(run)
        recorded[guard] = [int(line.split()[-1]) for line in result.stderr.splitlines()
                           if line.startswith("guarded collectives:")]
    assert sorted(losses["true"]) == [1, 2, 3] and losses["true"] == losses["false"]  # bit-identical
    assert recorded["false"] == [0, 0] and min(recorded["true"]) > 10, recorded
