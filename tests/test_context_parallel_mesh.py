"""The "cp" mesh dimension: world = dp x cp x tp, tp innermost (consecutive ranks), then cp, then dp.

A world of 4 on gloo (the reused rank pool, whose harness set up tp = 4; each case rebuilds the groups). Each
group's membership is read twice: from torch's own record and by an all-reduce of one-hot global ranks over it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from torch.distributed.device_mesh import init_device_mesh

import parallel_attention as pa

TIMEOUT_S = 180


def _members(group) -> tuple[tuple[int, ...], tuple[int, ...]]:
    one_hot = torch.zeros(dist.get_world_size())
    one_hot[dist.get_rank()] = 1
    dist.all_reduce(one_hot, group=group)
    return tuple(dist.get_process_group_ranks(group)), tuple(one_hot.nonzero().flatten().tolist())


def _layout_worker(tp, cp):
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(tp, context_parallel_size=cp)
    groups = {"tp": pa.get_tensor_model_parallel_group(), "cp": pa.get_context_parallel_group(),
              "dp": pa.get_data_parallel_group(), "dp_cp": pa.get_data_context_parallel_group()}
    mesh = pa.get_device_mesh()
    return {"members": {name: _members(g) for name, g in groups.items()},
            "sizes": (pa.get_data_parallel_world_size(), pa.get_context_parallel_world_size(),
                      pa.get_tensor_model_parallel_world_size()),
            "ranks": (pa.get_data_parallel_rank(), pa.get_context_parallel_rank(), pa.get_tensor_model_parallel_rank()),
            "mesh": (mesh.mesh_dim_names, mesh.mesh.tolist(), mesh["cp"].get_group() is groups["cp"])}


# (tp, cp) -> per rank: tp members, cp members, dp members, dp x cp members (world 4)
LAYOUTS = {
    (2, 2): [((0, 1), (0, 2), (0,), (0, 2)), ((0, 1), (1, 3), (1,), (1, 3)),
             ((2, 3), (0, 2), (2,), (0, 2)), ((2, 3), (1, 3), (3,), (1, 3))],
    (1, 2): [((0,), (0, 1), (0, 2), (0, 1, 2, 3)), ((1,), (0, 1), (1, 3), (0, 1, 2, 3)),
             ((2,), (2, 3), (0, 2), (0, 1, 2, 3)), ((3,), (2, 3), (1, 3), (0, 1, 2, 3))],
    (1, 4): [((r,), (0, 1, 2, 3), (r,), (0, 1, 2, 3)) for r in range(4)],
    (2, 1): [((0, 1), (0,), (0, 2), (0, 2)), ((0, 1), (1,), (1, 3), (1, 3)),
             ((2, 3), (2,), (0, 2), (0, 2)), ((2, 3), (3,), (1, 3), (1, 3))],
}


@pytest.mark.parametrize("tp,cp", list(LAYOUTS), ids=[f"tp{t}-cp{c}" for t, c in LAYOUTS])
def test_ranks_are_laid_out_tp_innermost_then_cp_then_dp(tp, cp):
    dp = 4 // (tp * cp)
    for rank, got in enumerate(run_distributed(_layout_worker, 4, 4, tp, cp, timeout=TIMEOUT_S)):
        want = dict(zip(("tp", "cp", "dp", "dp_cp"), LAYOUTS[tp, cp][rank]))
        assert got["members"] == {name: (m, m) for name, m in want.items()}, rank
        assert got["sizes"] == (dp, cp, tp)
        assert got["ranks"] == (rank // (tp * cp), rank // tp % cp, rank % tp)
        assert got["mesh"] == (("pp", "dp", "cp", "tp"), torch.arange(4).view(1, dp, cp, tp).tolist(), True)


def _adopt_worker(shape, names):
    pa.destroy_model_parallel()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    pa.initialize_model_parallel(mesh=mesh)
    cp = pa.get_context_parallel_group()
    return {"mesh": pa.get_device_mesh() is mesh, "cp_size": pa.get_context_parallel_world_size(),
            "cp_rank": pa.get_context_parallel_rank(),
            "cp": None if cp is None else cp is mesh["cp"].get_group(),
            "dp_cp": _members(pa.get_data_context_parallel_group())[1]}


def test_a_callers_dp_cp_tp_mesh_is_adopted_and_an_old_dp_tp_mesh_is_cp_1():
    for rank, got in enumerate(run_distributed(_adopt_worker, 4, 4, (1, 2, 2), ("dp", "cp", "tp"), fresh=True,
                                               timeout=TIMEOUT_S)):
        assert got == {"mesh": True, "cp_size": 2, "cp_rank": rank // 2, "cp": True,
                       "dp_cp": (rank % 2, rank % 2 + 2)}, rank
    for rank, got in enumerate(run_distributed(_adopt_worker, 4, 4, (2, 2), ("dp", "tp"), fresh=True,
                                               timeout=TIMEOUT_S)):
        assert got == {"mesh": True, "cp_size": 1, "cp_rank": 0, "cp": None, "dp_cp": (rank % 2, rank % 2 + 2)}, rank


def _refusal_worker(tp, cp):
    pa.destroy_model_parallel()
    try:
        pa.initialize_model_parallel(tp, context_parallel_size=cp)
    except ValueError as error:
        return str(error), pa.model_parallel_is_initialized()
    return None, pa.model_parallel_is_initialized()


def test_sizes_whose_product_does_not_divide_the_world_are_refused_by_name():
    message, initialized = run_distributed(_refusal_worker, 4, 4, 2, 3, timeout=TIMEOUT_S)[0]
    assert not initialized
    assert "tensor_model_parallel_size=2 x context_parallel_size=3 = 6" in message and "world size 4" in message
    message, _ = run_distributed(_refusal_worker, 4, 4, 1, 0, timeout=TIMEOUT_S)[0]
    assert "context_parallel_size=0 must be a positive integer" in message
