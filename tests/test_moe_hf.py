"""Hugging Face mixtures of experts: transformers' own Mixtral, Qwen2-MoE (a gated shared expert, a dense first layer),
Qwen3-MoE (per-head q/k norms, renormalised top-k) and OLMoE (q/k norms over the whole projections, split over the tp
ranks), tiny, random, saved by transformers 5, give their logits in GPTModel at (tp 1, ep 1), (tp 2, ep 1) and
(tp 1, ep 2); every expert arrives at its index with its gate and up halves (compared with transformers' fused
tensors bit for bit, every half distinct), and an export, directly or through convert_hf.py import --ep 2,
reshard_checkpoint.py --tp 2 and convert_hf.py export, loads back in transformers bit-equal."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import parallel_attention as pa
from distributed import run_distributed
from hf_fixtures import LOGITS_TOLERANCE, gpt_logits_worker, relative_error
from parallel_attention.checkpointing.format import model_file, step_dir_name
from parallel_attention.hf.convert import canonical_to_hf, hf_to_canonical
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 301, 12
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
FIXTURES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=16,
        mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, head_dim=8, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, eos_token_id=None)),
}
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _build(config_class: str, model_class: str, extra: dict):
    config = getattr(transformers, config_class)(**BASE, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # norms perturbed, and every expert's gate and up halves made distinct
        for name, param in model.named_parameters():
            if "norm" in name or "gate_up_proj" in name or "down_proj" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict:
    """{name: (directory, transformers model, its logits [b, s, V])}."""
    root, out = tmp_path_factory.mktemp("moe_hf"), {}
    for name, spec in FIXTURES.items():
        model = _build(*spec)
        model.save_pretrained(root / name)
        with torch.no_grad():
            out[name] = (root / name, model, model(TOKENS).logits)
    return out


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_expert_arrives_at_its_index_with_its_halves(fixtures, name):
    """transformers' fused in-memory tensors against the canonical ones read from its per-expert files: every
    expert's gate and up halves hold distinct values, so a swapped, shifted or dropped expert or half fails."""
    directory, model, _ = fixtures[name]
    cfg, canonical = hf_to_canonical(directory)
    assert cfg.num_experts == FIXTURES[name][2].get("num_experts", 4)
    mlp = {key: value for key, value in model.state_dict().items() if ".mlp." in key}
    fused = [value for key, value in mlp.items() if key.endswith("experts.gate_up_proj")]
    assert len(fused) == (1 if name == "qwen2_moe" else 2)
    halves = [half for layer in fused for expert in layer for half in expert.chunk(2)]
    assert len(halves) == 2 * cfg.num_experts * len(fused)
    assert len({tuple(half.flatten().tolist()) for half in halves}) == len(halves)  # no two alike
    for key, value in mlp.items():  # the canonical names are transformers' module names without "model."
        assert torch.equal(canonical[key.removeprefix("model.")], value), f"{name}: {key}"


def _ep_logits_worker(cases, tokens, ep: int):
    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1, expert_model_parallel_size=ep)
    return gpt_logits_worker(cases, tokens)


@pytest.mark.parametrize("layout", ["tp1", "tp2", "ep2"])
def test_imported_logits_match_transformers(fixtures, layout):
    names = sorted(fixtures)
    cases = [hf_to_canonical(fixtures[name][0]) for name in names]
    if layout == "ep2":
        ranks = run_distributed(_ep_logits_worker, 2, 1, cases, TOKENS, 2)
    else:
        p = int(layout[-1])
        ranks = run_distributed(gpt_logits_worker, p, p, cases, TOKENS)
    for rank, per_model in enumerate(ranks):
        for name, ours in zip(names, per_model):
            error = relative_error(ours, fixtures[name][2])
            assert error <= LOGITS_TOLERANCE, f"{name} {layout} rank {rank}: max error {error:.2e}"


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_export_loads_back_in_transformers_bit_equal(fixtures, name, tmp_path):
    directory, model, logits = fixtures[name]
    cfg, canonical = hf_to_canonical(directory)
    source = json.loads((directory / "config.json").read_text())
    canonical_to_hf(cfg, canonical, tmp_path / "export", source_config=source)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    assert type(loaded) is type(model)
    theirs = model.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, theirs[key]), f"{name}: {key}"
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, logits)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_import_at_ep2_reshard_to_tp2_export_is_bit_equal(fixtures, tmp_path, name):
    """convert_hf.py import --tp 1 --ep 2 -> reshard_checkpoint.py --tp 2 --ep 1 -> convert_hf.py export ->
    transformers: every weight bit-equal (experts, routers, Qwen2-MoE's shared expert and its gate and dense layer,
    the q/k norms: OLMoE's split between the tp 2 shards as the heads are)."""
    from launch import ROOT, run_command

    directory, model, logits = fixtures[name]
    steps = [["scripts/convert_hf.py", "import", "--hf", directory, "--out", tmp_path / "ep2", "--tp", "1", "--ep", "2"],
             ["scripts/reshard_checkpoint.py", "--in", tmp_path / "ep2", "--out", tmp_path / "tp2", "--tp", "2",
              "--ep", "1"],
             ["scripts/convert_hf.py", "export", "--checkpoint", tmp_path / "tp2", "--out", tmp_path / "export"]]
    for step in steps:
        result = run_command([sys.executable, *map(str, step)], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    assert "expert_parallel_size: 2" in (tmp_path / "ep2" / "config.yaml").read_text()
    assert "expert_parallel_size: 1" in (tmp_path / "tp2" / "config.yaml").read_text()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    theirs = model.state_dict()
    assert all(torch.equal(value, theirs[key]) for key, value in loaded.state_dict().items())
    if name == "olmoe":  # tp rank 1 holds the second half of each q/k norm: the rows of its heads
        shard = load_file(str(tmp_path / "tp2" / "checkpoints" / step_dir_name(0) / model_file(1)))
        for n in "qk":
            full = theirs[f"model.layers.0.self_attn.{n}_norm.weight"]
            assert torch.equal(shard[f"layers.0.attention.{n}_norm.weight"], full.chunk(2)[1]), n
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, logits)


def test_fused_expert_files_import_and_a_missing_expert_is_refused_by_name(fixtures, tmp_path):
    """transformers 5's fused tensors (experts.gate_up_proj [E, 2f, h]) import as the per-expert files do; a file
    without one expert's up_proj is refused, naming the layer, the projection and the expert."""
    from safetensors.torch import save_file

    directory, model, _ = fixtures["qwen3_moe"]
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((directory / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(fused / "model.safetensors"))
    _, from_fused = hf_to_canonical(fused)
    _, from_split = hf_to_canonical(directory)
    assert from_fused.keys() == from_split.keys()
    assert all(torch.equal(from_fused[k], from_split[k]) for k in from_split)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.4.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.experts: up_proj of experts \[4\] missing"):
        hf_to_canonical(broken)


def test_olmoe_config_misfits_are_named(fixtures, tmp_path):
    """OLMoE's clamp of q, k and v is refused by name; its projection-wide q/k norm is inferred as OLMoE on export and
    refused as Qwen3-MoE (whose norm is per head), and the reverse."""
    from parallel_attention.hf.config import hf_config_from_model, infer_architecture

    directory = fixtures["olmoe"][0]
    olmoe, _ = hf_to_canonical(directory)
    assert (olmoe.qk_norm, olmoe.qk_norm_scope, olmoe.moe_router_renormalize) == (True, "projection", False)
    assert infer_architecture(olmoe) == "OlmoeForCausalLM"
    with pytest.raises(ValueError, match=r"as Qwen3MoeForCausalLM: .*qk_norm_scope='projection' \(needs 'head'\)"):
        hf_config_from_model(olmoe, "Qwen3MoeForCausalLM")
    qwen3, _ = hf_to_canonical(fixtures["qwen3_moe"][0])
    with pytest.raises(ValueError, match=r"qk_norm_scope='head' \(needs 'projection'\)"):
        hf_config_from_model(qwen3, "OlmoeForCausalLM")
    clipped = tmp_path / "clipped"
    clipped.mkdir()
    (clipped / "config.json").write_text(json.dumps({**json.loads((directory / "config.json").read_text()),
                                                     "clip_qkv": 8.0}))
    with pytest.raises(ValueError, match=r"clip_qkv=8.0 is not supported by OlmoeForCausalLM import"):
        hf_to_canonical(clipped)
