"""Every invalid setting and bad input raises a ValueError that names the values."""

from __future__ import annotations

import pytest
import torch

import parallel_attention as pa
from distributed import run_distributed
from parallel_attention.transformer import apex_available


@pytest.mark.parametrize("kwargs,needles", [
    (dict(hidden_size=24, num_heads=6, num_kv_heads=4), ["num_heads=6", "num_kv_heads=4"]),
    (dict(hidden_size=20, num_heads=6), ["hidden_size=20", "num_heads=6", "head_dim"]),
    (dict(hidden_size=16, num_heads=4, attention_dropout=1.0), ["attention_dropout=1.0", "[0, 1)"]),
    (dict(hidden_size=16, num_heads=4, attention_dropout=-0.1), ["attention_dropout=-0.1"]),
    (dict(hidden_size=16, num_heads=4, attention_kernel="flash3"), ["attention_kernel='flash3'", "auto"]),
    (dict(hidden_size=16, num_heads=4, attention_kernel="apex"), ["attention_kernel='apex'", "not installed", "auto"]),
    (dict(hidden_size=0, num_heads=4), ["hidden_size=0"]),
    (dict(hidden_size=16, num_heads=4, head_dim=3, rotary=True), ["head_dim=3", "even"]),
    (dict(hidden_size=16, num_heads=4, params_dtype=torch.int32), ["params_dtype"]),
    (dict(hidden_size=16, num_heads=4, rope_theta=0.0), ["rope_theta=0.0"]),
])
def test_invalid_config_names_values(kwargs, needles):
    if kwargs.get("attention_kernel") == "apex" and apex_available():
        pytest.skip("NVIDIA apex is installed here, so attention_kernel='apex' is valid")
    with pytest.raises(ValueError) as info:
        pa.AttentionConfig(**kwargs)
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize("num_heads,num_kv_heads,p,needles", [
    (6, 6, 4, ["num_heads=6", "tensor_parallel_size=4"]),
    (8, 4, 8, None),  # p a multiple of num_kv_heads: k/v heads replicated, allowed
    (12, 6, 4, ["num_kv_heads=6", "tensor_parallel_size=4"]),  # p < nkv, nkv not divisible by p
    (12, 4, 6, ["tensor_parallel_size=6", "num_kv_heads=4", "multiple"]),  # p > nkv, not a multiple
])
def test_tensor_parallel_divisibility(num_heads, num_kv_heads, p, needles):
    cfg = pa.AttentionConfig(hidden_size=num_heads * 4, num_heads=num_heads, num_kv_heads=num_kv_heads)
    if needles is None:
        assert cfg.per_rank_heads(p) == (num_heads // p, 1)
        return
    with pytest.raises(ValueError) as info:
        cfg.per_rank_heads(p)
    for needle in needles:
        assert needle in str(info.value)


def indivisible_heads_worker():
    try:
        pa.ParallelSelfAttention(pa.AttentionConfig(hidden_size=24, num_heads=6))
    except ValueError as e:
        return str(e)
    return None


def test_module_refuses_heads_not_divisible_by_launched_p():
    messages = run_distributed(indivisible_heads_worker, 4, 4)
    assert all(m is not None and "num_heads=6" in m and "tensor_parallel_size=4" in m for m in messages)


@pytest.fixture
def module():
    return pa.ParallelSelfAttention(pa.AttentionConfig(hidden_size=16, num_heads=4))


@pytest.mark.parametrize("make_input,needle", [
    (lambda: torch.randn(5, 2, 12), "h=16"),
    (lambda: torch.randn(5, 16), "[s, b, h]"),
    (lambda: torch.randn(1, 5, 2, 16), "[s, b, h]"),
])
def test_bad_hidden_states(module, make_input, needle):
    with pytest.raises(ValueError) as info:
        module(make_input())
    assert needle in str(info.value) and "got shape" in str(info.value)


@pytest.mark.parametrize("mask,needle", [
    (torch.ones(2, 1, 1, 4, dtype=torch.bool), "(2, 1, 1, 4)"),
    (torch.ones(3, 1, 5, 5, dtype=torch.bool), "(3, 1, 5, 5)"),
    (torch.ones(2, 5, 5, dtype=torch.bool), "(2, 5, 5)"),
    (torch.ones(2, 1, 1, 5), "boolean"),
])
def test_bad_mask(module, mask, needle):
    with pytest.raises(ValueError) as info:
        module(torch.randn(5, 2, 16), attention_mask=mask)
    assert needle in str(info.value)


def test_bad_position_ids(module):
    with pytest.raises(ValueError, match=r"position_ids .*\(2, 4\)"):
        module(torch.randn(5, 2, 16), position_ids=torch.zeros(2, 4, dtype=torch.long))


def test_canonical_state_dict_errors_name_tensor(module):
    sd = module.canonical_state_dict()
    sd["k_proj.weight"] = torch.zeros(8, 16)
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(8, 16\), expected \(16, 16\)"):
        module.load_canonical_state_dict(sd)
    del sd["k_proj.weight"]
    with pytest.raises(ValueError, match="missing \\['k_proj.weight'\\]"):
        module.load_canonical_state_dict(sd)


def test_single_rank_without_torch_distributed(module):
    assert not torch.distributed.is_initialized()
    out = module(torch.randn(5, 2, 16))
    assert out.shape == (5, 2, 16) and module.tp_size == 1
