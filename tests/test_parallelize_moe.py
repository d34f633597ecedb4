"""parallelize(transformers MoE model): Mixtral, Qwen2-MoE (a gated shared expert, a dense first layer), Qwen3-MoE
(per-head q/k norms) and OLMoE (q/k norms over the whole projections) at p = 2 against the unsharded model with the
same weights (tests/hf_fixtures.py MOE_FAMILIES, the router's aux loss on): greedy generate, logits, the loss and the
aux loss, every gradient (shards gathered to transformers' names), a clipped AdamW step; the exact collectives of a forward and a
backward; save_pretrained -> from_pretrained bit-equal; a bf16 model kept bf16; and the refusals.

Tolerances (float32): the sharded GEMMs and the all-reduced partial sums add the same products in another order
(about 1e-7 relative per op): logits, losses 1e-5 absolute; gradients and weights after the step 1e-5 of the
tensor's largest reference value (or of 1)."""

from __future__ import annotations

import copy

import pytest
import torch

import parallel_attention as pa
from distributed import run_distributed
from hf_fixtures import MOE_FAMILIES, VOCAB, build, build_moe
from parallel_attention.check.collective_counter import count_collectives
from parallel_attention.hf.families import FAMILIES, check_supported
from parallel_attention.hf.save_pretrained import full_hf_state_dict
from parallel_attention.tensor_parallel.audit import replica_mismatches

tf = pytest.importorskip("transformers")

MAX_NORM, LR = 0.05, 1e-2  # MAX_NORM below the fixtures' gradient norms: the clip is active


def _full_grads(model) -> dict[str, torch.Tensor]:
    """Every gradient of a parallelized model under transformers' names, gathered as its weights are (a collective):
    each parameter's data swapped for its gradient while full_hf_state_dict runs."""
    params = [p for p in model.parameters() if p.grad is not None]
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad
    try:
        return full_hf_state_dict(model)
    finally:
        for p, data in zip(params, saved):
            p.data = data


def _close(actual: dict, expected: dict, tolerance: float, what: str) -> None:
    """Every tensor of `expected` in `actual`, within `tolerance` of its largest reference value (or of 1)."""
    assert set(expected) <= set(actual), (what, set(expected) - set(actual))
    for name, ref in expected.items():
        err = (actual[name] - ref.detach()).abs().max().item()
        assert err <= tolerance * max(ref.abs().max().item(), 1.0), (what, name, err)


def _check_family(name: str, out_dir: str) -> dict:
    reference = build_moe(name)
    model = pa.parallelize(copy.deepcopy(reference))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    pa.hf.save_pretrained(model, f"{out_dir}/{name}")  # before any step: the weights are the reference's
    reloaded = tf.AutoModelForCausalLM.from_pretrained(f"{out_dir}/{name}", dtype=torch.float32)
    assert all(torch.equal(t, reference.state_dict()[k]) for k, t in reloaded.state_dict().items()), name

    greedy = dict(attention_mask=torch.ones_like(ids[:, :5]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:, :5], **greedy), reference.generate(ids[:, :5], **greedy)), name

    reference.train(), model.train()
    expected = reference(ids, labels=ids)
    with count_collectives() as forward:
        actual = model(ids, labels=ids)
    for field in ("logits", "loss", "aux_loss"):
        err = (getattr(actual, field) - getattr(expected, field)).abs().max().item()
        assert err <= 1e-5, (name, field, err)
    assert actual.aux_loss > 0
    expected.loss.backward()
    with count_collectives() as backward:
        actual.loss.backward()
    ref_grads = {k: p.grad for k, p in reference.named_parameters()}
    assert all(grad.abs().max() > 0 for grad in ref_grads.values())  # every parameter is on a live path
    _close(_full_grads(model), ref_grads, 1e-5, f"{name} gradients")

    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, foreach=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM, foreach=True)
    norm = pa.clip_grad_norm_(model, MAX_NORM)
    assert ref_norm > MAX_NORM and abs(float(norm) - float(ref_norm)) <= 1e-5 * float(ref_norm), (name, norm)
    ref_opt.step(), opt.step()
    # Adam divides each gradient by its own magnitude: an element whose gradient is near zero moves by a visible
    # fraction of lr on float32 rounding alone (measured: 0.3%); a wrong or missing gradient moves it by about lr
    _close(full_hf_state_dict(model), dict(reference.named_parameters()), 1e-2 * LR, f"{name} weights after a step")
    assert replica_mismatches(model, pa.get_tensor_model_parallel_group(), None) == []
    return {"forward": dict(forward), "backward": dict(backward)}


def _check_all(out_dir: str) -> dict:
    return {name: _check_family(name, out_dir) for name in MOE_FAMILIES}


def test_moe_families_match_transformers_at_tp2(tmp_path):
    """Each count, 2 layers: forward, the embedding's all-reduce, per layer one for the attention output and ONE
    for the MoE block (routed sum plus shared expert), the loss's two; OLMoE adds one per layer (the projection
    norms' sums of squares). Backward: per layer the fused QKV's dX and the block's one (x, routing weights and
    the shared gate together), the head's dX; Qwen3-MoE adds one per layer (its per-head norm weights), OLMoE one
    (the projection norms' dot products). The logits' one all-gather forward."""
    counts = run_distributed(_check_all, 2, 2, str(tmp_path), timeout=600)[0]
    gather = {"all_gather_into_tensor": 1}
    assert counts["mixtral"] == {"forward": {"all_reduce": 7, **gather}, "backward": {"all_reduce": 5}}
    assert counts["qwen2_moe"] == {"forward": {"all_reduce": 7, **gather}, "backward": {"all_reduce": 5}}
    assert counts["qwen3_moe"] == {"forward": {"all_reduce": 7, **gather}, "backward": {"all_reduce": 7}}
    assert counts["olmoe"] == {"forward": {"all_reduce": 9, **gather}, "backward": {"all_reduce": 7}}
    # p > num_kv_heads: per layer one more for the fused QKV's k/v replica rows, one for the k norm's
    assert counts["olmoe_one_kv_head"] == {"forward": {"all_reduce": 9, **gather}, "backward": {"all_reduce": 11}}


def test_a_bf16_model_stays_bf16():
    """p = 1 without torch.distributed: the parallel pieces take transformers' dtype (and device), so a bf16 model
    (MoE or dense) runs; logits within two bf16 steps (2 x 2^-8 relative) of the model's own, the fused QKV
    accumulating in another order."""
    for reference in (build_moe("qwen2_moe"), build("llama_gqa")):
        reference = reference.to(torch.bfloat16)
        model = pa.parallelize(copy.deepcopy(reference))
        assert {param.dtype for param in model.parameters()} == {torch.bfloat16}
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected, actual = reference(ids).logits.float(), model(ids).logits.float()
        assert (actual - expected).abs().max() <= 2 * 2 ** -8 * expected.abs().max()


@pytest.mark.parametrize("name, overrides, p, message", [
    ("qwen3_moe", {"moe_intermediate_size": 25}, 2, "moe_intermediate_size=25 is not divisible by tensor-parallel"),
    ("qwen2_moe", {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 18}, 4,
     "shared_expert_intermediate_size=18"),
    ("mixtral", {"router_jitter_noise": 0.1}, 2, "router_jitter_noise=0.1"),
    ("olmoe", {"clip_qkv": 8.0}, 2, "clip_qkv=8.0"),
])
def test_moe_refusals_name_the_value(name, overrides, p, message):
    model = build_moe(name, **overrides)
    with pytest.raises(ValueError, match=message):
        check_supported(model, FAMILIES[type(model).__name__], p)
