"""Configs: every shipped YAML loads and validates; bad keys, types and layouts fail early and clearly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from parallel_attention import load_config

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = {"gpt_tiny.yaml": 2, "quickstart.yaml": 2, "gpt2_124m.yaml": 8, "llama_1b_tp8.yaml": 8,
           "llama_1b_32k_tp2_cp4.yaml": 8, "llama_70b_pp.yaml": 128, "moe_tiny.yaml": 2,
           "qwen3_30b_a3b.yaml": 16}  # config -> world size it is sized for


def test_every_shipped_config_is_listed_here():
    assert sorted(p.name for p in (ROOT / "configs").glob("*.yaml")) == sorted(SHIPPED)


@pytest.mark.parametrize("name,world", SHIPPED.items())
def test_shipped_config_loads_and_validates(name, world):
    cfg = load_config(ROOT / "configs" / name)
    cfg.validate(world)
    assert cfg.parallel.tensor_parallel_size <= world


def test_llama_config_is_gqa_rotary_rmsnorm_swiglu_at_p8():
    cfg = load_config(ROOT / "configs" / "llama_1b_tp8.yaml")
    m = cfg.model
    assert (m.num_kv_heads < m.num_heads, m.position_embedding, m.norm, m.activation) == (True, "rotary", "rmsnorm",
                                                                                          "swiglu")
    assert cfg.parallel.tensor_parallel_size == 8


def test_dotted_overrides_parse_yaml_values():
    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml",
                      ["--model.num_layers=6", "--optimizer.lr=3e-4", "--model.num_kv_heads=null",
                       "--parallel.sequence_parallel=true"])
    assert (cfg.model.num_layers, cfg.optimizer.lr, cfg.model.num_kv_heads, cfg.parallel.sequence_parallel) == \
        (6, 3e-4, None, True)


@pytest.mark.parametrize("overrides,needles", [
    (["--model.num_layer=4"], ["model.num_layer (did you mean model.num_layers?)"]),
    (["--training.oops.deep=1"], ["training.oops"]),
    (["--model.num_layers=four"], ["model.num_layers='four'", "expected int"]),
    (["--optimizer.lr=fast"], ["optimizer.lr='fast'", "float"]),
    (["--model.norm=batchnorm"], ["model.norm='batchnorm'", "layernorm", "rmsnorm"]),
    (["--parallel.sequence_parallel=3"], ["parallel.sequence_parallel=3", "bool"]),
    (["model.num_layers"], ["--section.key=value"]),
])
def test_bad_keys_and_types_are_named(overrides, needles):
    with pytest.raises(ValueError) as info:
        load_config(ROOT / "configs" / "gpt_tiny.yaml", overrides)
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize("misspelt,unknown,meant", [
    ("modle.num_layers", "modle", "model"), ("model.num_layer", "model.num_layer", "model.num_layers"),
    ("parallel.tensor_parallel", "parallel.tensor_parallel", "parallel.tensor_parallel_size"),
    ("data.tokeniser", "data.tokeniser", "data.tokenizer"),
    ("optimizer.weight_decy", "optimizer.weight_decy", "optimizer.weight_decay"),
    ("schedule.warmup", "schedule.warmup", "schedule.warmup_steps"),
    ("training.max_step", "training.max_step", "training.max_steps"),
    ("checkpoint.intervall", "checkpoint.intervall", "checkpoint.interval"),
    ("logging.rundir", "logging.rundir", "logging.run_dir"),
])
def test_a_misspelt_key_names_the_nearest_known_one(tmp_path, misspelt, unknown, meant):
    section, key = misspelt.split(".")
    path = tmp_path / "typo.yaml"
    path.write_text(f"{section}:\n  {key}: 2\n")
    for source, overrides in ((None, [f"--{misspelt}=2"]), (path, [])):  # a CLI override, a YAML key
        with pytest.raises(ValueError) as info:
            load_config(source, overrides)
        assert f"unknown config key(s): {unknown} (did you mean {meant}?); known keys here: " in str(info.value)


def test_a_key_near_nothing_gets_no_guess():
    with pytest.raises(ValueError) as info:
        load_config(None, ["--model.zzz=1"])
    assert "model.zzz; known keys here: " in str(info.value) and "did you mean" not in str(info.value)


@pytest.mark.parametrize("overrides,world,needles", [
    ([], 3, ["tensor_parallel_size=2", "world size 3"]),
    (["--model.num_heads=6", "--model.hidden_size=96"], 4, ["num_heads=6", "tensor_parallel_size=4"]),
    (["--training.global_batch_size=12", "--training.micro_batch_size=8"], 2, ["global_batch_size=12", "8"]),
    (["--parallel.sequence_parallel=true", "--data.seq_len=127"], 2, ["seq_len=127"]),
    (["--data.tokenizer=gpt2"], 2, ["vocab_size=256", "50257"]),
    (["--data.seq_len=512"], 2, ["seq_len=512", "max_seq_len=128"]),
])
def test_impossible_layouts_fail_in_validate(overrides, world, needles):
    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", [*overrides, f"--parallel.tensor_parallel_size="
                                                            f"{4 if world == 4 else 2}"])
    with pytest.raises(ValueError) as info:
        cfg.validate(world)
    for needle in needles:
        assert needle in str(info.value)


def test_pretrain_entry_rejects_before_any_process_group(monkeypatch, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_entry", ROOT / "scripts" / "pretrain.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert entry.main(["--config", str(ROOT / "configs" / "gpt_tiny.yaml")]) == 2
    assert "tensor_parallel_size=2" in capsys.readouterr().err
    assert entry.main(["--config", str(ROOT / "configs" / "gpt_tiny.yaml"), "--model.hidden=3"]) == 2
    assert "model.hidden" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("old,new,value", [("parallel.backend", "parallel.distributed_backend", "gloo"),
                                           ("model.attention_backend", "model.attention_kernel", "math")])
def test_renamed_keys_still_load_with_a_warning(tmp_path, old, new, value):
    section, key = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {key}: {value}\n")
    for source, overrides in ((path, []), (None, [f"--{old}={value}"])):
        with pytest.warns(FutureWarning, match=new):
            cfg = load_config(source, overrides)
        assert getattr(getattr(cfg, section), new.split(".")[1]) == value
    with pytest.raises(ValueError, match=f"{old}.*{new}"):
        load_config(path, [f"--{new}={value}"])


def test_a_saved_config_with_old_names_reads_silently(recwarn):
    from parallel_attention.training import config_from_dict

    cfg = config_from_dict({"model": {"attention_backend": "math"}, "parallel": {"backend": "gloo"}})
    assert (cfg.model.attention_kernel, cfg.parallel.distributed_backend) == ("math", "gloo")
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


def test_validation_errors_are_config_errors():
    from parallel_attention.training import ConfigError

    with pytest.raises(ConfigError, match="tensor_parallel_size=3"):
        load_config(None, ["--parallel.tensor_parallel_size=3"]).validate(4)


def test_the_70b_pipeline_config_fits_an_80_gb_gpu_per_stage():
    """Llama-3-70B's shape at tp 8 x pp 8 x dp 2 (16 nodes of 8): the run summary's stages row, from the config
    alone, gives every stage its layers (balanced by FLOPs: the embedding costs next to nothing and the output layer
    about one layer, so 9 on the last stage, 11 on the one before), its cost and its weights, gradients and AdamW
    state per GPU."""
    from parallel_attention.training.run.pipeline_summary import layer_parameters, pipeline_rows

    cfg = load_config(ROOT / "configs" / "llama_70b_pp.yaml")
    cfg.validate(128)
    assert 0.85e9 < layer_parameters(cfg) < 0.87e9  # Llama-3-70B: 856M a layer
    rows = pipeline_rows(cfg, 128, cfg.gradient_accumulation_steps(128))
    assert rows["pipeline"].startswith("8 stages, 1f1b, 128 micro-batches: bubble (p-1)/(m+p-1) = 0.052")
    stages = rows["stages"].split("; ")
    assert len(stages) == 8 and stages[0].startswith("stage 0: layers 0-9 + embedding")
    assert stages[7].startswith("stage 7: layers 71-79 + output layer and loss")
    shares = [int(re.search(r"\(([0-9]+) % of the step\)", s).group(1)) for s in stages]
    assert all(12 <= share <= 14 for share in shares), shares
    gib = [float(re.search(r"([0-9.]+) GiB/rank", s).group(1)) for s in stages]
    assert all(8 < g < 20 for g in gib), gib


def test_the_qwen3_30b_a3b_config_has_its_parameters_active_and_total_and_fits_an_h100():
    """Qwen3-30B-A3B's shape: the run summary's experts row, from the config alone, gives its published 30.5B
    parameters and 3.3B active per token, and at its layout (16 GPUs: ep 16 over dp 16, ZeRO-3, micro-batch 1, full
    recomputation) what each GPU holds, state and activations, within an H100's 80 GB (74.5 GiB)."""
    from parallel_attention.training.run.moe_summary import moe_rows, parameter_counts

    cfg = load_config(ROOT / "configs" / "qwen3_30b_a3b.yaml")
    cfg.validate(16)
    assert (cfg.parallel.zero_stage, cfg.parallel.expert_parallel_size) == (3, 16)
    counts = parameter_counts(cfg.model)
    assert 30.4e9 < counts["total"] < 30.6e9 and 3.3e9 < counts["active"] < 3.4e9
    row = moe_rows(cfg, 16)["experts"]
    assert "30.53B parameters, 3.35B active per token; ep 16: 8 experts a rank" in row
    state, activations, total = map(float, re.search(
        r"([0-9.]+) GiB/rank of weights, gradients and AdamW \(ZeRO-3\) \+ about ([0-9.]+) GiB of activations at "
        r"micro-batch 1 \(4096 tokens a rank, full recomputation\) = ([0-9.]+) GiB/rank", row).groups())
    assert 25 < state < 32 and 5 < activations < 10 and total < 74.5
    # 16 sequences a rank (what ep 16 over dp 16 needed before validation batches were padded) would not fit
    crowded = load_config(ROOT / "configs" / "qwen3_30b_a3b.yaml", ["--training.micro_batch_size=16"])
    assert float(re.search(r"= ([0-9.]+) GiB/rank", moe_rows(crowded, 16)["experts"]).group(1)) > 100
