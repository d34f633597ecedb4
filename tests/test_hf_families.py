"""The newer Hugging Face families through import and export: Llama 3.x rope scaling (rope_type llama3),
Qwen2 (bias on q, k, v only), Qwen3 (per-head RMSNorm on q and k) and Mistral.

Fixtures are tiny transformers models made here with a fixed seed (nothing is downloaded), their weights
perturbed so that biases and norm weights are not at their initial values. Imported, their logits match
transformers' at p = 1, 2, 4 (one spawned world per p checks all four); exported, transformers loads them
back with the same logits. Kinds of rope scaling the rotary embedding does not compute are refused by name.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face import/export tests need transformers (pip install -e .[hf])")

import parallel_attention as pa  # noqa: E402
from distributed import run_distributed  # noqa: E402
from hf_fixtures import (LOGITS_TOLERANCE, gpt_logits_worker, gpt_model_logits, hf_logits,  # noqa: E402
                         relative_error, save_perturbed_hf_model)
from parallel_attention import GPTModel, canonical_to_hf, hf_to_canonical  # noqa: E402
from parallel_attention.hf import read_hf_config  # noqa: E402

# every config field of these fixtures is read: a warning about an unknown one is a converter bug
pytestmark = pytest.mark.filterwarnings("error:config.json fields:UserWarning")

VOCAB, SEQ = 300, 40  # vocabulary not a multiple of 64 p; positions up to 39, past the llama3 original length
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
# llama3 scaling over original_max_position_embeddings=16: wavelengths over 16 are divided by 8, those between
# 16/4 and 16 interpolated. With head_dim 8 and theta 10000 the wavelengths are 6.3, 63, 628, 6283: every
# frequency changes, so that at positions up to 39 ignoring the scaling moves the logits far past 1e-4.
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}
FIXTURES = {
    "llama3_rope_scaling": ("LlamaConfig", "LlamaForCausalLM", {
        **BASE, "rope_parameters": {**LLAMA3_SCALING, "rope_theta": 10000.0}}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {
        **BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {  # head_dim 16 * 8 heads != hidden 64; tied embeddings
        **BASE, "head_dim": 16, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**BASE, "sliding_window": 48}),
}


TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """{name: (directory, transformers logits)}."""
    root = tmp_path_factory.mktemp("families")
    return {name: (root / name, save_perturbed_hf_model(*spec, root / name, TOKENS)[1])
            for name, spec in FIXTURES.items()}


@pytest.mark.parametrize("p", [1, 2, 4])
def test_imported_logits_match_transformers(fixtures, p):
    names = sorted(fixtures)
    cases = [hf_to_canonical(fixtures[name][0]) for name in names]
    for rank, per_model in enumerate(run_distributed(gpt_logits_worker, p, p, cases, TOKENS, timeout=300)):
        for name, ours in zip(names, per_model):
            error = relative_error(ours, fixtures[name][1])
            assert error <= LOGITS_TOLERANCE, f"{name} p={p} rank {rank}: max error {error:.2e} of the largest logit"


def test_what_each_family_imports_as(fixtures):
    cfgs = {name: hf_to_canonical(fixtures[name][0])[0] for name in fixtures}
    assert (cfgs["llama3_rope_scaling"].rope_type, cfgs["llama3_rope_scaling"].rope_original_max_seq_len) == \
        ("llama3", 16)
    assert (cfgs["qwen2"].qkv_bias, cfgs["qwen2"].out_bias, cfgs["qwen2"].qk_norm) == (True, False, False)
    assert (cfgs["qwen3"].qkv_bias, cfgs["qwen3"].out_bias, cfgs["qwen3"].qk_norm) == (False, False, True)
    assert cfgs["mistral"].max_seq_len == 48 and cfgs["mistral"].rope_type == "default"
    _, canonical = hf_to_canonical(fixtures["qwen3"][0])
    assert canonical["layers.1.attention.k_norm.weight"].shape == (16,)


def test_ignoring_the_llama3_scaling_would_fail(fixtures):
    """The fixture exercises the scaling: the unscaled rotary embedding misses transformers' logits."""
    hf_dir, ref = fixtures["llama3_rope_scaling"]
    cfg, canonical = hf_to_canonical(hf_dir)
    assert relative_error(gpt_model_logits(cfg, canonical, TOKENS), ref) <= LOGITS_TOLERANCE
    unscaled = dataclasses.replace(cfg, rope_type="default")
    assert relative_error(gpt_model_logits(unscaled, canonical, TOKENS), ref) > 100 * LOGITS_TOLERANCE


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_export_loads_back_in_transformers(fixtures, name, tmp_path):
    hf_dir, ref = fixtures[name]
    cfg, canonical = hf_to_canonical(hf_dir)
    canonical_to_hf(cfg, canonical, tmp_path / "out", source_config=read_hf_config(hf_dir))
    assert read_hf_config(tmp_path / "out")["architectures"] == [FIXTURES[name][1]]
    assert torch.equal(hf_logits(tmp_path / "out", TOKENS), ref)  # the same tensors and config, bit for bit
    cfg2, canonical2 = hf_to_canonical(tmp_path / "out")
    assert cfg2 == cfg and all(torch.equal(canonical2[k], canonical[k]) for k in canonical)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama3_rope_scaling"])
def test_export_without_source_infers_the_architecture(fixtures, name, tmp_path):
    hf_dir, ref = fixtures[name]
    cfg, canonical = hf_to_canonical(hf_dir)
    canonical_to_hf(cfg, canonical, tmp_path / "out")
    expected = FIXTURES[name][1]
    assert read_hf_config(tmp_path / "out")["architectures"] == [expected]
    assert torch.equal(hf_logits(tmp_path / "out", TOKENS), ref)


def test_script_import_tp4_then_export_qwen3(fixtures, tmp_path):
    path = Path(__file__).resolve().parents[1] / "scripts" / "convert_hf.py"
    spec = importlib.util.spec_from_file_location("convert_hf", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    hf_dir, ref = fixtures["qwen3"]
    run = tmp_path / "run"
    assert script.main(["import", "--hf", str(hf_dir), "--out", str(run), "--tp", "4"]) == 0
    assert pa.load_config(run / "config.yaml").model.qk_norm is True
    assert script.main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "out")]) == 0
    assert torch.equal(hf_logits(tmp_path / "out", TOKENS), ref)


def _edited(hf_dir: Path, tmp_path: Path, edit: dict) -> Path:
    out = tmp_path / "edited"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({**read_hf_config(hf_dir), **edit}))
    (out / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    return out


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn", "longrope"])
def test_a_refused_rope_type_names_itself(fixtures, tmp_path, rope_type):
    hf_dir = fixtures["llama3_rope_scaling"][0]
    edit = {"rope_parameters": {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}}
    with pytest.raises(ValueError, match=rf"rope_type='{rope_type}' is not supported.*'default' and 'llama3'"):
        hf_to_canonical(_edited(hf_dir, tmp_path, edit))


def test_llama3_in_the_transformers_4_spelling(fixtures, tmp_path):
    """transformers < 5 writes rope_theta at the top level and the scaling as rope_scaling (with 'type' in
    the oldest files)."""
    hf_dir = fixtures["llama3_rope_scaling"][0]
    edit = {"rope_parameters": None, "rope_theta": 10000.0,
            "rope_scaling": {**{k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"}, "type": "llama3"}}
    cfg, _ = hf_to_canonical(_edited(hf_dir, tmp_path, edit))
    assert cfg == hf_to_canonical(hf_dir)[0]


def test_qwen_sliding_layers_bound_the_sequence(fixtures, tmp_path):
    hf_dir = fixtures["qwen2"][0]
    edit = {"use_sliding_window": True, "sliding_window": 24, "layer_types": ["full_attention", "sliding_attention"]}
    assert hf_to_canonical(_edited(hf_dir, tmp_path, edit))[0].max_seq_len == 24  # the window never bites


# ------------------------------------------------------------------------------ qk_norm under tensor parallelism
QK_NORM = dict(vocab_size=203, hidden_size=32, num_layers=2, num_heads=8, num_kv_heads=2, activation="swiglu",
               norm="rmsnorm", position_embedding="rotary", tie_embeddings=False, qkv_bias=True, out_bias=False,
               mlp_bias=False, ffn_hidden_size=40, max_seq_len=16, qk_norm=True, rope_type="llama3",
               rope_original_max_seq_len=4)


def _qk_norm_grads(cfg, canonical, tokens, sequence_parallel):
    model = GPTModel(cfg, sequence_parallel=sequence_parallel)
    model.load_canonical_state_dict(canonical)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    names = [n for n, _ in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))]
    params = dict(model.named_parameters())
    before = {n: params[n].grad.clone() for n in names}
    pa.finalize_grads(model)
    return loss.item(), before, {n: params[n].grad.clone() for n in names}


def _qk_norm_case(canonical, tokens, sequence_parallel):
    return _qk_norm_grads(pa.ModelConfig(**QK_NORM), canonical, tokens, sequence_parallel)


def _qk_norm_canonical():
    torch.manual_seed(5)
    canonical = GPTModel(pa.ModelConfig(**QK_NORM)).canonical_state_dict()
    g = torch.Generator().manual_seed(6)
    return {k: v + 0.1 * torch.randn(v.shape, generator=g) if "norm" in k else v for k, v in canonical.items()}


@pytest.mark.parametrize("p,sp", [(2, False), (4, False), (4, True)])
def test_qk_norm_gradients_are_partial_and_completed(p, sp):
    """Each rank's q/k norm gradient covers only its heads (p = 4 > num_kv_heads = 2: k replicas too);
    finalize_grads sums them to p = 1's (float32: ~1e-7 relative, summation order only)."""
    canonical = _qk_norm_canonical()
    torch.manual_seed(3)
    tokens = torch.randint(0, 203, (3, 9))
    (ref_loss, _, ref), = run_distributed(_qk_norm_case, 1, 1, canonical, tokens, False, timeout=300)
    for rank, (loss, before, after) in enumerate(run_distributed(_qk_norm_case, p, p, canonical, tokens, sp,
                                                                 timeout=300)):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), f"p={p} sp={sp} rank {rank}"
        for name, grad in ref.items():
            scale = grad.abs().max().item()
            assert (after[name] - grad).abs().max().item() <= 1e-5 * scale, f"{name} p={p} sp={sp} rank {rank}"
            assert (before[name] - grad).abs().max().item() > 1e-3 * scale, f"{name}: already complete?"


# ------------------------------------------------------------------------------ run config keys
def test_run_config_keys_and_their_errors():
    cfg = pa.load_config(None, ["--model.qk_norm=true", "--model.rope_type=llama3", "--model.position_embedding=rotary"])
    assert cfg.model.qk_norm and cfg.model.rope_scaling().rope_type == "llama3"
    assert pa.load_config(None).model.qk_norm is False  # default off
    with pytest.raises(ValueError, match="model.rope_type='yarn'"):
        pa.load_config(None, ["--model.rope_type=yarn"])
    with pytest.raises(ValueError, match=r"rope_type='yarn' is not supported.*'default' and 'llama3'"):
        pa.ModelConfig.from_dict({"rope_type": "yarn"}).attention_config()
    bad = pa.ModelConfig(rope_type="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=4.0)
    with pytest.raises(ValueError, match="high_freq_factor=4.0 must exceed low_freq_factor=4.0"):
        bad.attention_config()
    # a model section written before these keys existed means what it did then
    assert pa.ModelConfig.from_dict({"hidden_size": 64}) == pa.ModelConfig(hidden_size=64)
