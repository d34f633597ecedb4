"""Hugging Face import/export: logits of imported models match transformers' at p = 1, 2, 4; export
round trips are exact; every misfit (tensor, shape, field, architecture) is named in its error.

Models are built from configs with random weights (nothing is downloaded) and perturbed so that
biases and norm weights are not at their trivial initial values.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face import/export tests need transformers (pip install -e .[hf])")

from distributed import run_distributed  # noqa: E402
from hf_fixtures import (LOGITS_TOLERANCE, gpt_logits_worker, gpt_model_logits, hf_logits,  # noqa: E402
                         relative_error, save_perturbed_hf_model)
from launch import ROOT, environment, run_command, torchrun
from parallel_attention import ModelConfig, canonical_to_hf, hf_to_canonical, load_config  # noqa: E402
from parallel_attention.hf import read_hf_config  # noqa: E402
from parallel_attention.checkpointing import read_canonical_checkpoint  # noqa: E402
from parallel_attention.training import ConfigError  # noqa: E402

VOCAB = 300  # not a multiple of 64 p: the model's internal vocabulary padding is exercised
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, rope_theta=500000.0, tie_word_embeddings=False, max_position_embeddings=64,
             rms_norm_eps=1e-5)
GPT2 = dict(vocab_size=VOCAB, n_embd=48, n_head=4, n_layer=2, n_positions=64, bos_token_id=None, eos_token_id=None)
VARIANTS = {  # checked at p = 1, in process
    "llama_biases_tied_head_dim": ("LlamaConfig", "LlamaForCausalLM", {
        **LLAMA, "num_key_value_heads": 4, "head_dim": 16, "attention_bias": True, "mlp_bias": True,
        "tie_word_embeddings": True}),
    "mistral_sliding_window": ("MistralConfig", "MistralForCausalLM", {
        **LLAMA, "sliding_window": 32}),
    "gpt2_untied_n_inner": ("GPT2Config", "GPT2LMHeadModel", {
        **GPT2, "n_inner": 80, "layer_norm_epsilon": 1e-4, "tie_word_embeddings": False}),
}


TOKENS = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    error = relative_error(ours, ref)
    assert error <= LOGITS_TOLERANCE, f"{what}: max error {error:.2e} relative to the largest logit"


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{name: (directory, transformers logits)} for the two main test models."""
    root = tmp_path_factory.mktemp("hf")
    specs = {"llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA), "gpt2": ("GPT2Config", "GPT2LMHeadModel", GPT2)}
    return {name: (root / name, save_perturbed_hf_model(*spec, root / name, TOKENS)[1]) for name, spec in specs.items()}


# ------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("p", [1, 2, 4])
def test_imported_logits_match_transformers(hf_models, p):
    names = sorted(hf_models)
    cases = [hf_to_canonical(hf_models[name][0]) for name in names]
    for rank, per_model in enumerate(run_distributed(gpt_logits_worker, p, p, cases, TOKENS)):
        for name, ours in zip(names, per_model):
            _assert_close(ours, hf_models[name][1], f"{name} p={p} rank {rank}")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_export_round_trip_is_exact(hf_models, name, tmp_path):
    hf_dir, ref = hf_models[name]
    cfg, canonical = hf_to_canonical(hf_dir)
    canonical_to_hf(cfg, canonical, tmp_path / "out", source_config=read_hf_config(hf_dir))
    assert read_hf_config(tmp_path / "out")["architectures"] == read_hf_config(hf_dir)["architectures"]
    assert torch.equal(hf_logits(tmp_path / "out", TOKENS), ref)  # the same tensors, bit for bit
    cfg2, canonical2 = hf_to_canonical(tmp_path / "out")
    assert cfg2 == cfg and canonical2.keys() == canonical.keys()
    assert all(torch.equal(canonical2[k], canonical[k]) for k in canonical)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_match_and_round_trip(variant, tmp_path):
    config_cls, model_cls, fields = VARIANTS[variant]
    _, ref = save_perturbed_hf_model(config_cls, model_cls, fields, tmp_path / "hf", TOKENS)
    cfg, canonical = hf_to_canonical(tmp_path / "hf")
    _assert_close(gpt_model_logits(cfg, canonical, TOKENS), ref, variant)
    canonical_to_hf(cfg, canonical, tmp_path / "out", source_config=read_hf_config(tmp_path / "hf"))
    assert read_hf_config(tmp_path / "out")["architectures"] == [model_cls]
    assert torch.equal(hf_logits(tmp_path / "out", TOKENS), ref)


def test_mistral_sliding_window_bounds_the_sequence(tmp_path):
    save_perturbed_hf_model(*VARIANTS["mistral_sliding_window"], tmp_path / "hf", TOKENS)
    cfg, _ = hf_to_canonical(tmp_path / "hf")
    assert cfg.max_seq_len == 32  # min(max_position_embeddings=64, sliding_window=32): the window never bites


def test_sharded_files_both_ways(hf_models, tmp_path):
    _, ref = save_perturbed_hf_model("LlamaConfig", "LlamaForCausalLM", LLAMA, tmp_path / "hf", TOKENS,
                                     max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    cfg, canonical = hf_to_canonical(tmp_path / "hf")
    single_cfg, single = hf_to_canonical(hf_models["llama"][0])
    assert cfg == single_cfg and all(torch.equal(canonical[k], single[k]) for k in single)
    canonical_to_hf(cfg, canonical, tmp_path / "out", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert torch.equal(hf_logits(tmp_path / "out", TOKENS), ref)


def test_gpt2_weights_without_base_prefix(hf_models, tmp_path):
    """The original hub GPT-2 names its tensors without `transformer.` (saved from the base model)."""
    hf_dir = hf_models["gpt2"][0]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, tmp_path / "hf" / "model.safetensors",
              metadata={"format": "pt"})
    _, expected = hf_to_canonical(hf_dir)
    _, canonical = hf_to_canonical(tmp_path / "hf")
    assert all(torch.equal(canonical[k], expected[k]) for k in expected)


def test_rope_theta_read_from_either_config_format(hf_models, tmp_path):
    """transformers < 5 writes rope_theta/rope_scaling at the top level, >= 5 a rope_parameters mapping."""
    hf = read_hf_config(hf_models["llama"][0])
    hf.pop("rope_parameters", None)
    hf.update(rope_theta=123456.0, rope_scaling=None)
    cfg, _ = hf_to_canonical(_copy_with_config(hf_models["llama"][0], tmp_path, hf))
    assert cfg.rope_theta == 123456.0


# ------------------------------------------------------------------------------ errors
def _copy_with_config(hf_dir: Path, tmp_path: Path, config: dict, tensors: dict | None = None) -> Path:
    out = tmp_path / "edited"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors if tensors is not None else load_file(hf_dir / "model.safetensors"), out / "model.safetensors",
              metadata={"format": "pt"})
    return out


def test_missing_tensor_is_named(hf_models, tmp_path):
    hf_dir = hf_models["llama"][0]
    tensors = load_file(hf_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        hf_to_canonical(_copy_with_config(hf_dir, tmp_path, read_hf_config(hf_dir), tensors))


def test_shape_that_disagrees_with_config_is_named(hf_models, tmp_path):
    hf_dir = hf_models["llama"][0]
    config = {**read_hf_config(hf_dir), "num_key_value_heads": 4}  # k/v: 4 heads of 8 = 32 rows, file has 16
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight .* shape \(16, 64\), "
                                         r"but config\.json implies \(32, 64\)"):
        hf_to_canonical(_copy_with_config(hf_dir, tmp_path, config))


def test_unexpected_tensor_is_named(hf_models, tmp_path):
    hf_dir = hf_models["gpt2"][0]
    tensors = {**load_file(hf_dir / "model.safetensors"), "transformer.h.0.attn.extra.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.extra\.weight"):
        hf_to_canonical(_copy_with_config(hf_dir, tmp_path, read_hf_config(hf_dir), tensors))


@pytest.mark.parametrize("model,edit,field", [
    ("llama", {"architectures": ["BertModel"], "model_type": "bert"}, "BertModel"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope_parameters"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("gpt2", {"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn"),
    ("gpt2", {"activation_function": "relu"}, "activation_function"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention"),
    ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_config_is_named(hf_models, tmp_path, model, edit, field):
    hf_dir = hf_models[model][0]
    with pytest.raises(ValueError, match=field):
        hf_to_canonical(_copy_with_config(hf_dir, tmp_path, {**read_hf_config(hf_dir), **edit}))


def test_unknown_config_field_warns(hf_models, tmp_path):
    hf_dir = hf_models["llama"][0]
    with pytest.warns(UserWarning, match="logit_softcapping"):
        hf_to_canonical(_copy_with_config(hf_dir, tmp_path, {**read_hf_config(hf_dir), "logit_softcapping": 30.0}))


def test_export_refuses_what_neither_family_expresses(hf_models, tmp_path):
    cfg, canonical = hf_to_canonical(hf_models["llama"][0])
    mixed = ModelConfig(**{**cfg.__dict__, "norm": "layernorm"})
    with pytest.raises(ValueError, match=r"neither GPT-2 nor Llama.*norm='layernorm'"):
        canonical_to_hf(mixed, canonical, tmp_path / "a")
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel: .*num_kv_heads=2"):
        canonical_to_hf(cfg, canonical, tmp_path / "b", architecture="GPT2LMHeadModel")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        canonical_to_hf(cfg, canonical, tmp_path / "c")


def _truncated_copy(hf_dir: Path, out: Path, name: str) -> Path:
    """A copy of `hf_dir` in `out` whose file `name` lost its second half."""
    out.mkdir(parents=True)
    for path in hf_dir.iterdir():
        (out / path.name).write_bytes(path.read_bytes())
    whole = (out / name).read_bytes()
    (out / name).write_bytes(whole[: len(whole) // 2])
    return out


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_truncated_file_is_named_with_its_size(hf_models, tmp_path, name):
    damaged = _truncated_copy(hf_models["llama"][0], tmp_path / "damaged", name)
    size = (damaged / name).stat().st_size
    with pytest.raises(ValueError, match=rf"{damaged / name} \({size} bytes\) is not .*copy or download it again"):
        hf_to_canonical(damaged)


def test_a_truncated_or_missing_shard_or_index_is_named(hf_models, tmp_path):
    cfg, canonical = hf_to_canonical(hf_models["llama"][0])
    sharded = canonical_to_hf(cfg, canonical, tmp_path / "sharded", max_shard_bytes=40_000)
    index = "model.safetensors.index.json"
    shard = sorted(set(json.loads((sharded / index).read_text())["weight_map"].values()))[1]
    with pytest.raises(ValueError, match=rf"{tmp_path / 'a' / index} \(\d+ bytes\) is not valid UTF-8 JSON"):
        hf_to_canonical(_truncated_copy(sharded, tmp_path / "a", index))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'b' / shard} \(\d+ bytes\) is not a readable safetensors"):
        hf_to_canonical(_truncated_copy(sharded, tmp_path / "b", shard))
    (tmp_path / "b" / shard).unlink()
    with pytest.raises(ValueError, match=f"{index} places tensors in {shard}, which is missing"):
        hf_to_canonical(tmp_path / "b")


# ------------------------------------------------------------------------------ script
def _convert_script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "convert_hf.py"
    spec = importlib.util.spec_from_file_location("convert_hf", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_script_import_tp2_then_export(hf_models, name, tmp_path, capsys):
    hf_dir, ref = hf_models[name]
    script, run = _convert_script(), tmp_path / "run"
    assert script.main(["import", "--hf", str(hf_dir), "--out", str(run), "--tp", "2"]) == 0
    cfg = load_config(run / "config.yaml")
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.data.tokenizer == str(run / "tokenizer")
    assert (run / "tokenizer" / "MISSING").is_file()  # save_pretrained wrote weights only: no tokenizer
    warning = capsys.readouterr().err  # said at import, with the fix
    assert warning.startswith(f"warning: {hf_dir} has no tokenizer.json") and "--tokenizer PATH" in warning, warning
    with pytest.raises(ConfigError) as refused:  # training on text stops before it starts, naming the note and fix
        cfg.validate(world_size=2)
    assert f"only the note {run / 'tokenizer' / 'MISSING'}" in str(refused.value), refused.value
    assert "copy its tokenizer.json into" in str(refused.value) and "--tokenizer PATH" in str(refused.value)
    step_cfg, canonical = read_canonical_checkpoint(run / "checkpoints" / "step_0000000")
    expected_cfg, expected = hf_to_canonical(hf_dir)
    assert ModelConfig.from_dict(step_cfg["model"]) == expected_cfg and all(torch.equal(canonical[k], expected[k]) for k in expected)
    assert script.main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "out")]) == 0
    assert read_hf_config(tmp_path / "out")["architectures"] == read_hf_config(hf_dir)["architectures"]
    assert torch.equal(hf_logits(tmp_path / "out", TOKENS), ref)
    assert not (tmp_path / "out" / "MISSING").exists()


def test_import_takes_the_tokenizer_from_tokenizer_path(hf_models, tmp_path, capsys):
    from parallel_attention.training.data.prepare.bpe import train_bpe

    tokenizer = tmp_path / "elsewhere" / "my_tokenizer.json"
    tokenizer.parent.mkdir()
    train_bpe(["import os", "def main(): pass"] * 20, 300, tokenizer)
    run = tmp_path / "run"
    argv = ["import", "--hf", str(hf_models["llama"][0]), "--out", str(run), "--tp", "1", "--tokenizer", str(tokenizer)]
    assert _convert_script().main(argv) == 0
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    assert not (run / "tokenizer" / "MISSING").exists() and "warning" not in capsys.readouterr().err


def test_small_vocabulary_without_tokenizer_imports_and_generation_says_how(tmp_path):
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, "vocab_size": 100})).save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    assert _convert_script().main(["import", "--hf", str(tmp_path / "hf"), "--out", str(run), "--tp", "1"]) == 0
    assert load_config(run / "config.yaml").model.vocab_size == 100
    result = run_command([sys.executable, str(ROOT / "scripts" / "generate.py"), "--checkpoint", str(run)],
                         env=environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (f"error: this model was imported without a tokenizer: copy its tokenizer.json "
                                     f"into {run / 'tokenizer'}/ or set data.tokenizer=PATH (a tokenizer.json or a "
                                     "directory holding one), or pass --tokenizer PATH")


def test_script_reports_an_impossible_layout(hf_models, tmp_path, capsys):
    script = _convert_script()
    assert script.main(["import", "--hf", str(hf_models["llama"][0]), "--out", str(tmp_path / "run"),
                        "--tp", "3"]) == 2
    assert "num_heads=8 is not divisible by tensor_parallel_size=3" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_script_import_of_a_truncated_model_says_one_line(hf_models, tmp_path):
    damaged = _truncated_copy(hf_models["gpt2"][0], tmp_path / "damaged", "model.safetensors")
    result = run_command([sys.executable, str(ROOT / "scripts" / "convert_hf.py"), "import", "--hf", str(damaged),
                          "--out", str(tmp_path / "run"), "--tp", "1"],
                         env=environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cannot import: {damaged / 'model.safetensors'} ("), lines


def test_script_export_names_a_damaged_recorded_config(hf_models, tmp_path, capsys):
    script, run = _convert_script(), tmp_path / "run"
    assert script.main(["import", "--hf", str(hf_models["gpt2"][0]), "--out", str(run), "--tp", "1"]) == 0
    (run / "hf_config.json").write_text('{"architectures": ["GPT2')
    assert script.main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "out")]) == 2
    assert f"cannot export: {run / 'hf_config.json'} (" in capsys.readouterr().err


def test_import_leaves_no_unknown_field_warning(hf_models):
    """save_pretrained's own config.json is fully accounted for (mapped, checked or known not to matter)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("llama", "gpt2"):
            hf_to_canonical(hf_models[name][0])


# ------------------------------------------------------------------------------ with its own tokenizer
SENTENCES = [f"the {a} {b} sat on the {c} mat number {i}." for i, (a, b, c) in enumerate(
    (a, b, c) for a in ("big", "small", "red", "old") for b in ("cat", "dog", "fox") for c in ("green", "blue", "flat"))]


def _llama_with_tokenizer(path: Path):
    """A byte-level BPE trained here (</s>: id 0, named eos in tokenizer_config.json) and a Llama of its
    vocabulary whose final norm is zero: every logit is 0, so greedy decoding picks id 0, the EOS."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES, tokenizers.trainers.BpeTrainer(
        vocab_size=320, special_tokens=["</s>"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "tokenizer_class":
                                                            "PreTrainedTokenizerFast"}))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, "vocab_size": tok.get_vocab_size(),
                                                                      "eos_token_id": 0, "bos_token_id": None}))
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(path)
    return tok


def _generated(run: Path, prompt: str) -> tuple[list[int], str]:
    out = torchrun("generate.py", 2, ["--checkpoint", str(run), "--prompt", prompt, "--max-new-tokens", "6",
                                      "--temperature", "0", "--print-tokens"], timeout=240).stdout
    first, text = out.split("\n", 1)
    assert first.startswith("tokens: ")
    return list(map(int, first.split()[1:])), text.removesuffix("\n")


def test_imported_tokenizer_trains_generates_and_exports(tmp_path):
    tok = _llama_with_tokenizer(tmp_path / "hf")
    run, corpus = tmp_path / "run", tmp_path / "corpus"
    assert _convert_script().main(["import", "--hf", str(tmp_path / "hf"), "--out", str(run), "--tp", "2"]) == 0
    assert sorted(p.name for p in (run / "tokenizer").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    prompt = tok.encode("the red fox").ids
    assert _generated(run, "the red fox") == (prompt + [0], "the red fox")  # its own tokenizer; stops at </s>

    corpus.mkdir()
    (corpus / "docs.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in SENTENCES * 4))
    torchrun("pretrain.py", 2, ["--config", str(run / "config.yaml"), "--resume", f"--data.source={corpus}",
                                "--data.seq_len=16", "--data.val_fraction=0.2", "--training.max_steps=2",
                                "--training.global_batch_size=4", "--training.micro_batch_size=2",
                                "--training.eval_interval=2", "--training.eval_batches=1", "--checkpoint.interval=2",
                                "--logging.progress_bar=false", "--logging.tensorboard=false"], timeout=300)
    assert (run / "checkpoints" / "step_0000002").is_dir()
    tokens, text = _generated(run, "the red fox")
    assert tokens[:len(prompt)] == prompt and len(tokens) > len(prompt)
    assert text == tok.decode([t for t in tokens if t != 0])  # decoded by the model's own tokenizer

    assert _convert_script().main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "out")]) == 0
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "out").iterdir()}
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert hf_tok.eos_token_id == 0 and hf_tok("the red fox", add_special_tokens=False).input_ids == prompt
