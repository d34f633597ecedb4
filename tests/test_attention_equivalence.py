"""ParallelSelfAttention at p = 1, 2, 4 against the independent single-device reference.

Same canonical weights, float64 reference, float32 module: output, input gradient and every
weight gradient. Sizes are awkward on purpose (h = 20 with 4 heads of 5; head_dim 6 with
h = 24 and 8 heads) so that a transposed or mis-sliced dimension cannot pass by accident.
"""

from __future__ import annotations

import pytest
import torch

import parallel_attention as pa
from parallel_attention.check.reference import reference_attention
from distributed import backend_for, device_params, local_device, run_distributed
from fused_rows import expected_fused_rows

# float32 module vs float64 reference: each output element sums ~h*d products with ~1e-7
# relative rounding each, so errors sit near 1e-6 of the largest value; 1e-5 leaves margin
# while a wrong slice, head or mask gives errors of order 1.
REL_TOL = 1e-5
S, B = 8, 3

CASES = {
    "mha_causal": dict(hidden_size=20, num_heads=4),
    "mha_padding_mask": dict(hidden_size=20, num_heads=4, mask="padding"),
    "gqa_rotary_packed_positions": dict(hidden_size=24, num_heads=8, num_kv_heads=2, head_dim=6, rotary=True,
                                        positions="packed"),
    "mqa_noncausal_pattern_mask": dict(hidden_size=16, num_heads=4, num_kv_heads=1, causal=False, mask="pattern"),
    "gqa_rotary_sequence_parallel": dict(hidden_size=24, num_heads=8, num_kv_heads=2, head_dim=6, rotary=True,
                                         sequence_parallel=True, mask="padding"),
    "mha_sequence_parallel_no_bias": dict(hidden_size=20, num_heads=4, qkv_bias=False, out_bias=False,
                                          sequence_parallel=True),
    "mqa_sequence_parallel_rotary": dict(hidden_size=16, num_heads=4, num_kv_heads=1, rotary=True,
                                         sequence_parallel=True, rope_theta=500.0),
    "gqa_math_backend_head_dim_10": dict(hidden_size=12, num_heads=4, num_kv_heads=2, head_dim=10, rotary=True,
                                         attention_kernel="math", mask="padding"),
    "mha_math_backend_pattern": dict(hidden_size=20, num_heads=4, attention_kernel="math", mask="pattern"),
}


def _make_mask(kind):
    if kind == "padding":  # left padding: batch 0 pads 3 keys, batch 2 pads 1; rows fully masked give zeros
        keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
        keep[0, ..., :3] = False
        keep[2, ..., :1] = False
        return keep
    if kind == "pattern":
        return torch.rand(B, 1, S, S) < 0.7
    return None


def _make_positions(kind):
    if kind == "packed":  # two packed documents per row, restarting at 0; row 1 with a gap
        pos = torch.cat([torch.arange(5), torch.arange(3)]).repeat(B, 1)
        pos[1] = torch.tensor([0, 1, 2, 5, 6, 0, 1, 2])
        return pos
    return None


def _rel(actual, expected):
    return ((actual.detach().double().cpu() - expected.detach()).abs().max() / expected.abs().max()).item()


def equivalence_worker(device_kind, case_names):
    device = local_device(device_kind)
    p, rank = pa.get_tensor_model_parallel_world_size(), pa.get_tensor_model_parallel_rank()
    errors = {}
    for name in case_names:
        spec = dict(CASES[name])
        mask_kind, pos_kind = spec.pop("mask", None), spec.pop("positions", None)
        sp = spec.pop("sequence_parallel", False)
        cfg = pa.AttentionConfig(**spec)
        torch.manual_seed(7)  # identical data and weights on every rank
        module = pa.ParallelSelfAttention(cfg, device=device, sequence_parallel=sp)
        ref_weights = {k: (torch.randn(v.shape, dtype=torch.float64) * 0.3).requires_grad_()
                       for k, v in module.canonical_state_dict().items()}
        module.load_canonical_state_dict({k: v.detach().float() for k, v in ref_weights.items()})
        x = torch.randn(S, B, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
        upstream = torch.randn(S, B, cfg.hidden_size, dtype=torch.float64)
        mask, positions = _make_mask(mask_kind), _make_positions(pos_kind)

        ref = reference_attention(x, ref_weights, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.causal,
                                  mask, cfg.rotary, positions, cfg.rope_theta)
        ref.backward(upstream)

        chunk = (lambda t: t.chunk(p, dim=0)[rank]) if sp else (lambda t: t)
        x_in = chunk(x.detach()).float().to(device).requires_grad_()
        out = module(x_in, None if mask is None else mask.to(device),
                     None if positions is None else positions.to(device))
        out.backward(chunk(upstream).float().to(device))
        pa.finalize_grads(module)

        fused = lambda kind: expected_fused_rows(  # noqa: E731
            *(ref_weights[f"{n}.{kind}"].grad for n in ("q_proj", "k_proj", "v_proj")),
            rank, p, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        err = {"output": _rel(out, chunk(ref)), "input_grad": _rel(x_in.grad, chunk(x.grad)),
               "qkv_weight_grad": _rel(module.query_key_value.weight.grad, fused("weight")),
               "dense_weight_grad": _rel(module.dense.weight.grad,
                                         ref_weights["o_proj.weight"].grad.chunk(p, dim=1)[rank])}
        if cfg.qkv_bias:
            err["qkv_bias_grad"] = _rel(module.query_key_value.bias.grad, fused("bias"))
        if cfg.out_bias:
            err["dense_bias_grad"] = _rel(module.dense.bias.grad, ref_weights["o_proj.bias"].grad)
        errors[name] = err
    return errors


@pytest.mark.parametrize("world_size,device", device_params())
def test_matches_single_device_reference(world_size, device):
    per_rank = run_distributed(equivalence_worker, world_size, world_size, device, list(CASES),
                               backend=backend_for(device))
    failures = [f"rank {r} {case} {what}: rel err {e:.2e}"
                for r, errs in enumerate(per_rank) for case, d in errs.items() for what, e in d.items()
                if not e <= REL_TOL]  # `not <=` also catches NaN
    assert not failures, "\n".join(failures)
    assert set(per_rank[0]) == set(CASES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash SDPA needs CUDA; the float32 CPU cases cover the math")
def test_cuda_bf16_flash_path_matches_reference():
    """bf16 on CUDA takes SDPA's flash kernel (causal, no mask); bf16 rounding (~4e-3) bounds the error."""
    cfg = pa.AttentionConfig(hidden_size=256, num_heads=4, num_kv_heads=2, rotary=True, params_dtype=torch.bfloat16)
    torch.manual_seed(0)
    module = pa.ParallelSelfAttention(cfg, device="cuda")
    weights = {k: v.double().cpu() for k, v in module.canonical_state_dict().items()}
    x = torch.randn(64, 2, 256, dtype=torch.float64)
    ref = reference_attention(x, weights, 4, 2, 64, rotary=True)
    with torch.backends.cuda.sdp_kernel(enable_math=False, enable_mem_efficient=False):
        out = module(x.to("cuda", torch.bfloat16))
    assert _rel(out.float(), ref) < 3e-2
