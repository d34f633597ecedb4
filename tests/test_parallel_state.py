"""Process groups: layout, getters, lifecycle, init_distributed, and the single-rank fallback.

Group membership is checked twice: through the getters, and by an all-reduce over each group of
a one-hot vector of the global rank, which shows exactly which ranks the group really joins.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import subprocess
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from distributed import backend_for, local_device, run_distributed

import parallel_attention as pa

WORLDS = [pytest.param(world, kind, id=f"p{world}-{kind}", marks=pytest.mark.skipif(
    kind == "cuda" and torch.cuda.device_count() < world, reason=f"needs {world} CUDA device(s) for NCCL; "
    "the cpu variant runs the same checks")) for world in (1, 2, 4) for kind in ("cpu", "cuda")]
SPAWN_TIMEOUT_S = 120


def _members_by_all_reduce(group, world, dev):
    one_hot = torch.zeros(world, device=dev)
    one_hot[dist.get_rank()] = 1
    dist.all_reduce(one_hot, group=group)
    return tuple(int(i) for i in one_hot.nonzero().flatten().tolist())


def _layout(dev):
    world = dist.get_world_size()
    tp, dp = pa.get_tensor_model_parallel_group(), pa.get_data_parallel_group()
    return {
        "tp_size": pa.get_tensor_model_parallel_world_size(), "tp_rank": pa.get_tensor_model_parallel_rank(),
        "dp_size": pa.get_data_parallel_world_size(), "dp_rank": pa.get_data_parallel_rank(),
        "tp_members": tuple(dist.get_process_group_ranks(tp)), "dp_members": tuple(dist.get_process_group_ranks(dp)),
        "tp_reduced": _members_by_all_reduce(tp, world, dev), "dp_reduced": _members_by_all_reduce(dp, world, dev),
    }


def _groups_worker(kind):
    """Every tensor-parallel size that divides the world, one after another in one process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = local_device(kind)
    assert pa.model_parallel_is_initialized()
    initial = _layout(dev)  # tp = world, set up by run_distributed
    with pytest.raises(RuntimeError, match="already"):
        pa.initialize_model_parallel(world)
    layouts = {}
    for tp in [t for t in (1, 2, 4) if world % t == 0]:
        pa.destroy_model_parallel()
        assert not pa.model_parallel_is_initialized()
        if world > 1:  # several ranks but no groups: a clear error, not a silent single rank
            with pytest.raises(RuntimeError, match="initialize_model_parallel"):
                pa.get_tensor_model_parallel_group()
        pa.initialize_model_parallel(tp)  # after destroy, groups can be made again, and work
        layouts[tp] = _layout(dev)
    assert layouts[world] == initial
    pa.destroy_model_parallel()
    with pytest.raises(ValueError, match=rf"\b{world}\b.*\b3\b"):  # world 1, 2, 4: none a multiple of 3
        pa.initialize_model_parallel(3)
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        pa.initialize_model_parallel(0)
    assert not pa.model_parallel_is_initialized()
    return rank, layouts


def _expected_layout(rank, world, tp):
    tp_members = tuple(range(rank // tp * tp, rank // tp * tp + tp))
    dp_members = tuple(range(rank % tp, world, tp))
    return {"tp_size": tp, "tp_rank": rank % tp, "dp_size": world // tp, "dp_rank": rank // tp,
            "tp_members": tp_members, "dp_members": dp_members, "tp_reduced": tp_members,
            "dp_reduced": dp_members}


@pytest.mark.parametrize("world_size,device", WORLDS)
def test_group_layout_and_lifecycle(world_size, device):
    results = run_distributed(_groups_worker, world_size, world_size, device, backend=backend_for(device),
                              fresh=True)
    for rank, layouts in results:
        assert sorted(layouts) == [tp for tp in (1, 2, 4) if world_size % tp == 0]
        for tp, layout in layouts.items():
            assert layout == _expected_layout(rank, world_size, tp), f"rank {rank}, tp={tp}"
    if world_size == 4:  # spelled out for tp = 2: TP pairs of consecutive ranks, DP across them
        assert [layouts[2]["tp_members"] for _, layouts in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
        assert [layouts[2]["dp_members"] for _, layouts in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]
        assert [layouts[2]["tp_reduced"] for _, layouts in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
        assert [layouts[2]["dp_reduced"] for _, layouts in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]


def test_single_rank_without_torch_distributed():
    assert not dist.is_initialized(), "an earlier test left a process group behind in the pytest process"
    assert not pa.model_parallel_is_initialized()
    assert pa.get_tensor_model_parallel_group() is None and pa.get_data_parallel_group() is None
    assert (pa.get_tensor_model_parallel_world_size(), pa.get_tensor_model_parallel_rank()) == (1, 0)
    assert (pa.get_data_parallel_world_size(), pa.get_data_parallel_rank()) == (1, 0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        pa.initialize_model_parallel(1)
    x = torch.randn(5, 2, 12, dtype=torch.float64)
    col = pa.ColumnParallelLinear(12, 20, gather_output=True, dtype=torch.float64)
    row = pa.RowParallelLinear(20, 7, dtype=torch.float64)
    emb = pa.VocabParallelEmbedding(9, 4, dtype=torch.float64)
    assert col.tp_group is None and row.tp_group is None and emb.tp_group is None
    assert col.weight.shape == (20, 12) and row.weight.shape == (7, 20) and emb.weight.shape == (9, 4)
    # the same operations in the same order: identical to the last bit
    assert torch.equal(col(x), F.linear(x, col.weight, col.bias))
    h = torch.randn(5, 2, 20, dtype=torch.float64)
    assert torch.equal(row(h), F.linear(h, row.weight) + row.bias)
    tokens = torch.tensor([[0, 8, 3], [5, 8, 1]])
    assert torch.equal(emb(tokens), F.embedding(tokens, emb.weight))


def test_init_distributed_without_torchrun_env_is_a_world_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    try:
        device = pa.init_distributed()
        assert dist.get_world_size() == 1 and dist.get_rank() == 0
        assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
        assert pa.model_parallel_is_initialized()
        assert pa.get_tensor_model_parallel_world_size() == 1 and pa.get_data_parallel_world_size() == 1
    finally:
        pa.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_init_distributed_nccl_without_cuda_is_rejected():
    with pytest.raises(ValueError, match="nccl"):
        pa.init_distributed(backend="nccl")
    assert not dist.is_initialized()


def test_a_multi_gpu_run_turns_on_nccls_flight_recorder_unless_the_environment_says_otherwise():
    from parallel_attention.tensor_parallel.mesh_groups import nccl_diagnostics_env

    assert nccl_diagnostics_env("nccl", 8, {}) == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                                                   "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert nccl_diagnostics_env("nccl", 8, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}) == {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}  # an explicit setting wins
    assert nccl_diagnostics_env("nccl", 1, {}) == {} and nccl_diagnostics_env("gloo", 8, {}) == {}


def _torchrun_worker(rank, world, port, results):
    """A process started as torchrun would start it: only environment variables, no init."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), CUDA_VISIBLE_DEVICES="")  # a CPU-only machine
    try:
        device = pa.init_distributed(tensor_model_parallel_size=2, timeout=SPAWN_TIMEOUT_S)
        tp = pa.get_tensor_model_parallel_group()
        results.put((rank, {
            "device": device, "backend": dist.get_backend(), "world": dist.get_world_size(),
            "tp": (pa.get_tensor_model_parallel_world_size(), pa.get_tensor_model_parallel_rank()),
            "dp": (pa.get_data_parallel_world_size(), pa.get_data_parallel_rank()),
            "tp_reduced": _members_by_all_reduce(tp, world, "cpu"),
        }))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        pa.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_init_distributed_from_torchrun_env():
    world, ctx = 2, mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_torchrun_worker, args=(r, world, port, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=SPAWN_TIMEOUT_S)
        while len(got) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            try:
                rank, value = results.get(timeout=max(left, 0.1))
            except queue.Empty:
                pytest.fail(f"ranks {sorted(set(range(world)) - set(got))} did not report in {SPAWN_TIMEOUT_S}s")
            assert not isinstance(value, str), f"rank {rank} failed:\n{value}"
            got[rank] = value
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    for rank in range(world):
        assert got[rank] == {"device": torch.device("cpu"), "backend": "gloo", "world": world, "tp": (2, rank),
                             "dp": (1, 0), "tp_reduced": (0, 1)}, f"rank {rank}"


def _gloo_threads_after_shutdown() -> tuple[list[str], bool, bool]:
    from parallel_attention.tensor_parallel import parallel_state as ps

    x = torch.ones(4)
    dist.all_reduce(x, group=pa.get_tensor_model_parallel_group())  # the groups' threads are up
    dist.all_reduce(x, group=pa.get_data_parallel_group())
    ps.shutdown_distributed()
    names = [_thread_name(task) for task in os.listdir("/proc/self/task")]
    return [n for n in names if "gloo" in n], dist.is_initialized(), pa.model_parallel_is_initialized()


def _thread_name(task: str) -> str:
    """The thread's name; '' for one that ended after the listing (a gloo thread still finishing: not running)."""
    try:
        with open(f"/proc/self/task/{task}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc")
def test_shutdown_distributed_leaves_no_gloo_thread_running():
    """torch's destroy_process_group alone leaves the groups that parallel_state holds, and their gloo threads,
    alive; such a process can abort at exit (SIGABRT, 'terminate called without an active exception')."""
    for threads, initialized, groups in run_distributed(_gloo_threads_after_shutdown, 4, 2, fresh=True):
        assert threads == [] and not initialized and not groups


_EXIT_SCRIPT = """
import atexit, os

def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return [n for n in names if "gloo" in n]

def report():  # registered before parallel_attention's import: runs after its exit handler
    from parallel_attention.tensor_parallel import parallel_state as ps
    print("at exit:", ps.model_parallel_is_initialized(), gloo_threads(), flush=True)

atexit.register(report)
import torch
import torch.distributed as dist
from parallel_attention.tensor_parallel import parallel_state as ps

ps.init_distributed(1)  # a world of one, its groups on gloo
x = torch.ones(2)
dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
dist.all_reduce(x, group=ps.get_data_parallel_group())
dist.destroy_process_group()  # torch's alone, without destroy_model_parallel
print("after destroy_process_group:", len(gloo_threads()), flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc")
def test_groups_left_held_are_released_at_exit():
    """A caller that destroys only the process group still exits with no gloo thread of ours left for the C++
    teardown (where such threads can abort the process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert int(lines[0].split(":")[1]) > 0, "the groups' threads were expected alive after destroy_process_group"
    assert lines[1] == "at exit: False []", done.stdout


def _split_group_worker():
    """The mesh's groups through one split_group call per dimension where torch can split (NCCL with a bound
    device; gloo cannot, so split_group is stood in for here by one new_group per row, as torch's would split)."""
    from parallel_attention.tensor_parallel import mesh_groups

    assert not mesh_groups.splits_in_one_call()  # gloo: one new_group per row
    calls, real_new_group, real_splits, real_split_group = [], dist.new_group, mesh_groups.splits_in_one_call, \
        dist.split_group

    def split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None):
        calls.append((group_desc, split_ranks, timeout))
        groups = [real_new_group(members, timeout=timeout, group_desc=group_desc) for members in split_ranks]
        return next(g for g, members in zip(groups, split_ranks) if dist.get_rank() in members)

    pa.destroy_model_parallel()
    mesh_groups.splits_in_one_call, dist.split_group = (lambda: True), split_group
    try:
        pa.initialize_model_parallel(2, timeout=datetime.timedelta(seconds=77))
        tp = pa.get_tensor_model_parallel_group()
        return calls, _members_by_all_reduce(tp, 2, "cpu"), mesh_groups.group_timeout(tp)
    finally:
        mesh_groups.splits_in_one_call, dist.split_group = real_splits, real_split_group
        pa.destroy_model_parallel()
        pa.initialize_model_parallel(2)


def test_each_mesh_dimension_is_one_split_group_call_where_torch_can_split():
    seventy_seven = datetime.timedelta(seconds=77)
    for calls, tp_members, timeout in run_distributed(_split_group_worker, 2, 2, timeout=SPAWN_TIMEOUT_S):
        assert calls == [("pp", [[0], [1]], seventy_seven), ("dp", [[0], [1]], seventy_seven),
                         ("cp", [[0], [1]], seventy_seven),
                         ("tp", [[0, 1]], seventy_seven)]
        assert tp_members == (0, 1) and timeout == seventy_seven
