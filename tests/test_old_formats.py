"""What 0.1 and 0.2 wrote, read by today's code through checkpointing/compatibility.py, the one module that knows
old formats: renamed keys under their new names, removed keys at their neutral value, keys added since at their
defaults, and a run config without data.sampling recognised as a run that drew random windows. The fixtures'
manifests are read as every load path reads them (`read_manifest`); tests/test_legacy_checkpoint.py resumes them to
the bit, and tests/test_config.py covers the YAML path (warnings, overrides, both names at once)."""

from __future__ import annotations

import json
import warnings

import pytest

from launch import ROOT
from parallel_attention.checkpointing import read_canonical_checkpoint, read_manifest
from parallel_attention.checkpointing.compatibility import (ADDED_KEYS, check_config, check_same_model,
                                                            model_shape_config, started_before_sampling,
                                                            upgrade_manifest, upgrade_run_config, upgrade_section)
from parallel_attention.training.config.schema import config_from_dict, load_config
from parallel_attention.transformer import ModelConfig

V0_1 = ROOT / "tests" / "data" / "legacy_v0_1_0"
V0_2 = ROOT / "tests" / "data" / "legacy_v0_2_0"
STEP = "checkpoints/step_0000003"


def _raw_config(fixture) -> dict:
    return json.loads((fixture / STEP / "manifest.json").read_text())["config"]


def test_a_v0_1_0_manifest_reads_under_todays_keys():
    raw, manifest = _raw_config(V0_1), read_manifest(V0_1 / STEP)
    model, parallel = manifest["config"]["model"], manifest["config"]["parallel"]
    assert "attention_backend" in raw["model"] and "backend" in raw["parallel"]  # what 0.1.0 wrote
    assert "attention_backend" not in model and model["attention_kernel"] == raw["model"]["attention_backend"]
    assert "backend" not in parallel and parallel["distributed_backend"] == raw["parallel"]["backend"]
    renamed = {k: v for k, v in raw["model"].items() if k != "attention_backend"}
    assert model == {**renamed, "attention_kernel": "auto", **ADDED_KEYS["model"]}  # added: written before they existed
    assert ModelConfig.from_dict(model).rope_type == "default"
    assert manifest["config"]["data"] == raw["data"]  # no sampling: the run keeps its random windows
    assert started_before_sampling(manifest["config"]) and started_before_sampling(raw)


def test_a_v0_2_0_manifest_and_run_config_read_unchanged():
    raw, manifest = _raw_config(V0_2), read_manifest(V0_2 / STEP)
    added = {k: v for k, v in ADDED_KEYS["model"].items() if k not in raw["model"]}  # since: MoE, qk_norm_scope
    assert set(added) == {"num_experts", "qk_norm_scope"} | {k for k in ADDED_KEYS["model"] if k.startswith("moe_")}
    # 0.2.0 wrote today's keys, but for data.sampling, the mixture-of-experts keys (read at their dense defaults) and
    # qk_norm_scope (read as 'head', the only q/k norm there was)
    assert manifest["config"] == {**raw, "model": {**raw["model"], **added}}
    assert started_before_sampling(raw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing old in it: no FutureWarning
        cfg = load_config(V0_2 / "config.yaml")
    assert cfg.to_dict()["model"] == {**raw["model"], **added}
    assert cfg.data.sampling == "epochs"  # resume.py sets random_windows


def test_a_raw_old_model_section_is_refused_naming_the_way_in():
    with pytest.raises(ValueError, match=r"\['attention_backend'\].*checkpointing.compatibility.upgrade_section"):
        ModelConfig.from_dict(_raw_config(V0_1)["model"])
    assert ModelConfig.from_dict(upgrade_section("model", _raw_config(V0_1)["model"])).attention_kernel == "auto"


def test_the_compatibility_checks_read_old_manifests_themselves():
    """check_same_model and check_config take a manifest as written (tests and tools hand them raw ones)."""
    raw = {"config": _raw_config(V0_1)}
    model = ModelConfig.from_dict(upgrade_section("model", raw["config"]["model"]))
    check_same_model(raw, model, "the 0.1.0 checkpoint")
    check_config(raw, {"model": model_shape_config(model)})
    assert upgrade_manifest(raw) == {"config": upgrade_run_config(raw["config"])}


def test_upgrading_is_idempotent_and_leaves_other_values_alone():
    once = upgrade_run_config(_raw_config(V0_1))
    assert upgrade_run_config(once) == once
    assert upgrade_run_config({"model": None, "parallel": 3, "other": {"backend": 1}}) == {
        "model": None, "parallel": 3, "other": {"backend": 1}}  # not mappings: the config loader names them
    assert upgrade_run_config([1]) == [1]


def test_removed_and_renamed_keys_in_a_saved_config():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a manifest is not the user's to edit: silent
        assert upgrade_section("parallel", {"comm_chunks": 1, "backend": "gloo"}) == {"distributed_backend": "gloo"}
    with pytest.raises(ValueError, match=r"parallel.comm_chunks=4: the key was removed in 0.2"):
        upgrade_section("parallel", {"comm_chunks": 4})
    with pytest.raises(ValueError, match="model.attention_backend and model.attention_kernel are both set"):
        upgrade_section("model", {"attention_backend": "math", "attention_kernel": "sdpa"})
    with pytest.warns(FutureWarning, match="model.attention_backend is the 0.1 name of model.attention_kernel"):
        upgrade_section("model", {"attention_backend": "math"}, warn=True)
    assert config_from_dict(_raw_config(V0_1)).parallel.distributed_backend == "auto"


def test_a_v0_1_0_checkpoint_reads_whole_with_its_rows_reordered():
    """Format 1 (per-group fused QKV rows) at p = 2, read through the reshard path: today's canonical weights."""
    saved, canonical = read_canonical_checkpoint(V0_1 / STEP)
    model = ModelConfig.from_dict(saved["model"])
    assert (model.num_heads, model.num_kv_heads, model.hidden_size) == (4, 2, 32)
    head_dim = model.hidden_size // model.num_heads
    assert [tuple(canonical[f"layers.0.attention.{x}_proj.weight"].shape) for x in "qkv"] == [
        (model.num_heads * head_dim, 32), (model.num_kv_heads * head_dim, 32), (model.num_kv_heads * head_dim, 32)]
