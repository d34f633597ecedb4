"""The caller's DeviceMesh: layers take a 1-D mesh as tp_group, initialize_model_parallel(mesh=...) adopts a
("dp", "tp") mesh, and init_distributed builds its groups as such a mesh (tp innermost, consecutive ranks).

World of 4 on gloo, fresh ranks: each worker first forgets the groups the test harness made, so that nothing of
ours exists before the caller's mesh does. The attention is compared in float64 with the single-device
reference of parallel_attention/check/reference.py (sizes awkward on purpose: h 20, 4 heads of 6, 2 k/v heads).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from attention_inputs import load_random_weights_and_data
from distributed import run_distributed
from fused_rows import expected_fused_rows
from refusals import value_error_messages
from torch.distributed.device_mesh import init_device_mesh

import parallel_attention as pa
from parallel_attention.check.reference import reference_attention

S, B, H, NH, NKV = 6, 3, 20, 4, 2
TOL = dict(rtol=1e-10, atol=1e-10)  # float64; the sharded block sums per-rank partials in another order


def _attention_against_reference(tp_group) -> None:
    cfg = pa.AttentionConfig(hidden_size=H, num_heads=NH, num_kv_heads=NKV, head_dim=6, rotary=True,
                             params_dtype=torch.float64)
    module = pa.ParallelSelfAttention(cfg, tp_group=tp_group)
    # identical weights and data on every rank
    weights, x, upstream = load_random_weights_and_data(module, torch.Generator().manual_seed(5), (S, B, H))
    ref = reference_attention(x, weights, NH, NKV, cfg.head_dim, True, None, True)
    ref.backward(upstream)
    x_in = x.detach().clone().requires_grad_()
    out = module(x_in)
    out.backward(upstream)
    p, r = module.tp_size, module.tp_rank
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(x_in.grad, x.grad, **TOL)
    grads = [weights[f"{n}.weight"].grad for n in ("q_proj", "k_proj", "v_proj")]
    torch.testing.assert_close(module.query_key_value.weight.grad,
                               expected_fused_rows(*grads, r, p, NH, NKV, cfg.head_dim), **TOL)
    torch.testing.assert_close(module.dense.weight.grad, weights["o_proj.weight"].grad.chunk(p, dim=1)[r], **TOL)


def _callers_mesh_worker():
    pa.destroy_model_parallel()  # the harness's groups: gone; only the caller's mesh from here on
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    _attention_against_reference(mesh["tp"])  # no initialize_model_parallel: the layer takes the 1-D mesh
    pa.initialize_model_parallel(mesh=mesh)
    adopted = {
        "mesh": pa.get_device_mesh() is mesh,
        "tp": pa.get_tensor_model_parallel_group() is mesh["tp"].get_group(),
        "dp": pa.get_data_parallel_group() is mesh["dp"].get_group(),
        "sizes": (pa.get_data_parallel_world_size(), pa.get_tensor_model_parallel_world_size()),
        "ranks": (pa.get_data_parallel_rank(), pa.get_tensor_model_parallel_rank()),
        "tp_members": dist.get_process_group_ranks(pa.get_tensor_model_parallel_group()),
    }
    _attention_against_reference(None)  # the default group is now the mesh's "tp" dimension
    model = pa.GPTModel(pa.ModelConfig(vocab_size=32, hidden_size=H, num_heads=NH, num_layers=1, max_seq_len=S))
    adopted["model_group"] = model.tp_group is mesh["tp"].get_group()
    return adopted


def test_a_callers_mesh_drives_the_block_and_is_adopted():
    for rank, adopted in enumerate(run_distributed(_callers_mesh_worker, 4, 4, fresh=True, timeout=180)):
        assert adopted == {"mesh": True, "tp": True, "dp": True, "sizes": (2, 2), "ranks": (rank // 2, rank % 2),
                           "tp_members": [rank // 2 * 2, rank // 2 * 2 + 1], "model_group": True}, rank


def _refusals_worker():
    pa.destroy_model_parallel()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "model"))
    messages = value_error_messages(lambda: pa.initialize_model_parallel(mesh=mesh),
                                    lambda: pa.ColumnParallelLinear(4, 4, tp_group=mesh))  # 2-D: which dimension?
    return messages, pa.model_parallel_is_initialized()


def test_a_mesh_without_our_dimensions_or_of_two_dimensions_is_refused_by_name():
    messages, initialized = run_distributed(_refusals_worker, 4, 4, fresh=True, timeout=180)[0]
    assert not initialized and len(messages) == 2, messages
    assert "('data', 'model')" in messages[0] and "('dp', 'tp')" in messages[0]
    assert "2-D mesh" in messages[1] and "mesh['tp']" in messages[1]


def _built_mesh_worker():
    mesh = pa.get_device_mesh()  # the harness's initialize_model_parallel(2)
    return (mesh.mesh_dim_names, tuple(mesh.shape), mesh["tp"].get_group() is pa.get_tensor_model_parallel_group(),
            mesh["dp"].get_group() is pa.get_data_parallel_group(), mesh.mesh.tolist())


def test_our_groups_are_a_pp_dp_cp_tp_mesh_with_tp_innermost():
    for names, shape, tp, dp, ranks in run_distributed(_built_mesh_worker, 4, 2):
        assert (names, shape, tp, dp, ranks) == (("pp", "dp", "cp", "tp"), (1, 2, 1, 2), True, True,
                                                 [[[[0, 1]], [[2, 3]]]])
