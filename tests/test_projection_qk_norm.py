"""The q/k norm over the whole projection (OLMoE's; `model.qk_norm_scope: projection`): at tp 2 and at tp 4 (which
replicates the 2 k/v heads, and with them the k norm's rows), with and without sequence parallelism, the loss and
every gradient equal one process's; each rank's weights are what checkpoint resharding (`model_layout`) writes for
it; its backward equals autograd's (gradcheck, float64); it costs exactly one all-reduce forward and one backward."""

from __future__ import annotations

import pytest
import torch

import parallel_attention as pa
from distributed import run_distributed
from parallel_attention.check.collective_counter import count_collectives
from parallel_attention.check.compare import canonical_grads
from parallel_attention.tensor_parallel.grad_clip import global_grad_norm
from parallel_attention.transformer.model_layout import shard_state_dict
from parallel_attention.transformer.norms import ProjectionRMSNorm, normalize_projections

# OLMoE-shaped (whole-projection q/k norms, no biases), awkward sizes: vocab 203, d 6, s 8
SPEC = dict(vocab_size=203, hidden_size=24, num_layers=2, num_heads=4, num_kv_heads=2, activation="swiglu",
            norm="rmsnorm", position_embedding="rotary", tie_embeddings=False, qkv_bias=False, out_bias=False,
            mlp_bias=False, ffn_hidden_size=40, max_seq_len=16, qk_norm=True, qk_norm_scope="projection")


def _canonical() -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    canonical = pa.GPTModel(pa.ModelConfig(**SPEC)).canonical_state_dict()
    g = torch.Generator().manual_seed(6)  # norm weights away from 1, so a mis-sliced weight cannot pass
    return {k: v + 0.3 * torch.randn(v.shape, generator=g) if "norm" in k else v for k, v in canonical.items()}


def _loss_and_grads(canonical, tokens, sequence_parallel):
    cfg = pa.ModelConfig(**SPEC)
    model = pa.GPTModel(cfg, sequence_parallel=sequence_parallel)
    model.load_canonical_state_dict(canonical)
    mine, p = model.state_dict(), pa.get_tensor_model_parallel_world_size()
    offline = shard_state_dict(cfg, list(mine), canonical, p, pa.get_tensor_model_parallel_rank())
    assert all(torch.equal(mine[key], offline[key]) for key in mine), "the checkpoint layout differs"
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    pa.finalize_grads(model)
    return loss.item(), global_grad_norm(model, pa.get_tensor_model_parallel_group()).item(), canonical_grads(model)


def _attention_counts(sequence_parallel):
    cfg = pa.ModelConfig(**SPEC).attention_config()
    module = pa.ParallelSelfAttention(cfg, sequence_parallel=sequence_parallel)
    p = pa.get_tensor_model_parallel_world_size()
    x = torch.randn(8 // p if sequence_parallel else 8, 2, 24, requires_grad=True)
    with count_collectives() as forward:
        out = module(x)
    with count_collectives() as backward:
        out.sum().backward()
    return dict(forward), dict(backward)


def _gradcheck():
    """The hand-written backward against autograd's numerical Jacobian (float64, one rank)."""
    q_norm, k_norm = (ProjectionRMSNorm(n, 6, 1e-6, pa.get_tensor_model_parallel_group(), dtype=torch.float64)
                      for n in (2, 1))
    torch.manual_seed(0)
    for norm in (q_norm, k_norm):
        norm.weight.data.add_(torch.randn_like(norm.weight) * 0.3)
    q = torch.randn(3, 2, 2, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 2, 1, 6, dtype=torch.float64, requires_grad=True)
    return torch.autograd.gradcheck(lambda *t: normalize_projections(t[0], t[1], q_norm, k_norm), (q, k))


def _worker(canonical, tokens):
    return ({sp: _loss_and_grads(canonical, tokens, sp) for sp in (False, True)},
            {sp: _attention_counts(sp) for sp in (False, True)},
            _gradcheck() if pa.get_tensor_model_parallel_world_size() == 1 else None)


@pytest.mark.parametrize("p", [2, 4])
def test_projection_qk_norm_equals_one_process(p):
    canonical = _canonical()
    torch.manual_seed(3)
    tokens = torch.randint(0, 203, (3, 9))
    (ref, ref_counts, gradcheck_passed), = run_distributed(_worker, 1, 1, canonical, tokens, timeout=300)
    assert gradcheck_passed
    assert ref_counts[False] == ({}, {})
    ref_loss, ref_norm, ref_grads = ref[False]
    assert any("q_norm" in name and grad.abs().max() > 0 for name, grad in ref_grads.items())
    for rank, (per_sp, counts, _) in enumerate(run_distributed(_worker, p, p, canonical, tokens, timeout=300)):
        for sp, (loss, norm, grads) in per_sp.items():
            where = f"tp {p} sequence_parallel={sp} rank {rank}"
            # float32, the same sums in another order (the projections' all-reduces): ~1e-7 relative
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), where
            assert abs(norm - ref_norm) <= 1e-5 * ref_norm, f"gradient norm at {where}"  # replicas counted once
            assert grads.keys() == ref_grads.keys()
            for name, ref_grad in ref_grads.items():
                scale = ref_grad.abs().max().item()
                assert (grads[name] - ref_grad).abs().max().item() <= 1e-5 * scale + 1e-9, f"{name} at {where}"
        # one all-reduce more each way than the attention block without the norm (its sums of squares, and of
        # g w x_hat): q and k share it
        assert counts[False] == ({"all_reduce": 2}, {"all_reduce": 2}), f"rank {rank}"
        assert counts[True] == ({"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "all_reduce": 1},
                                {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 1, "all_reduce": 1}), rank


def test_the_scope_is_a_model_key_and_an_unknown_one_is_refused():
    with pytest.raises(ValueError, match=r"qk_norm_scope='heads' is unknown; choose one of head, projection"):
        pa.ModelConfig(**{**SPEC, "qk_norm_scope": "heads"}).attention_config()
    config = pa.load_config(None, ["--model.qk_norm=true", "--model.qk_norm_scope=projection",
                                   "--model.position_embedding=rotary"])
    assert config.model.qk_norm_scope == "projection"
    assert pa.load_config(None).model.qk_norm_scope == "head"  # the default: Qwen3's per-head norm
