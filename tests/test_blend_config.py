"""data.blend and data.sampling as configured: parsed from YAML and overrides, checked before any process group,
one tokenizer across the sources, and a run started before data.sampling existed keeps its random windows."""

import json

import pytest

from launch import ROOT
from parallel_attention.training import ConfigError, load_config
from parallel_attention.training.config.schema import recorded_config
from parallel_attention.training.data.read.token_source import prepared_tokenizer
from parallel_attention.training.run.resume import keep_previous_sampling
from parallel_attention.training.data.token_files import DataFileError
from parallel_attention.training.data.read.token_source import TokenSource

TINY = ROOT / "configs" / "gpt_tiny.yaml"


def _prefix(tmp_path, name):
    for ext in ("bin", "idx"):
        (tmp_path / f"{name}.{ext}").write_bytes(b"")
    return str(tmp_path / name)


def test_a_blend_override_is_a_list_of_entries(tmp_path):
    a, b = _prefix(tmp_path, "a"), _prefix(tmp_path, "b")
    cfg = load_config(TINY, [f"--data.blend=[{{path: {a}, weight: 7}}, {{path: {b}, weight: 3}}]"])
    assert [(e.path, e.weight) for e in cfg.data.blend] == [(a, 7.0), (b, 3.0)]
    assert cfg.data.sampling == "epochs"
    cfg.validate(2)
    assert load_config(TINY).data.blend == []


@pytest.mark.parametrize("blend, sampling, message", [
    ("[{path: A, weight: 0}]", "epochs", r"data.blend\[0\].weight=0.0 must be a positive number"),
    ("[{path: A, weight: 1}, {path: NOWHERE, weight: 1}]", "epochs",
     r"data.blend\[1\].path='NOWHERE' is neither a directory nor a Megatron-LM prefix"),
    ("[{path: A, weight: 1}, {path: A, weight: 2}]", "random_windows", "random_windows reads a single source"),
])
def test_a_bad_blend_is_refused_naming_the_entry(tmp_path, blend, sampling, message):
    blend = blend.replace("A", _prefix(tmp_path, "a"))
    cfg = load_config(TINY, [f"--data.blend={blend}", f"--data.sampling={sampling}"])
    with pytest.raises(ConfigError, match=message):
        cfg.validate(2)


def test_data_source_beside_a_blend_is_refused_naming_both_keys(tmp_path):
    a = _prefix(tmp_path, "a")
    (tmp_path / "corpus").mkdir()
    cfg = load_config(TINY, [f"--data.blend=[{{path: {a}, weight: 1}}]", f"--data.source={tmp_path / 'corpus'}"])
    with pytest.raises(ConfigError, match=r"data.source='.*corpus' and data.blend are both set.*prepare_data.py "
                                          r"--source .*corpus --out DIR\) and add DIR to data.blend"):
        cfg.validate(2)


def test_a_blend_runs_config_yaml_claims_no_source(tmp_path):
    a = _prefix(tmp_path, "a")
    blended = load_config(TINY, [f"--data.blend=[{{path: {a}, weight: 1}}]"]).to_dict()
    recorded = recorded_config(blended)
    assert "source" not in recorded["data"] and "data_dir" not in recorded["data"] and "max_bytes" not in \
        recorded["data"]
    assert recorded["data"]["blend"] == [{"path": a, "weight": 1.0}] and recorded["model"] == blended["model"]
    plain = load_config(TINY).to_dict()
    assert recorded_config(plain) == plain  # a run of data.source records it, as before


def test_a_misspelt_blend_key_is_named_with_its_index(tmp_path):
    with pytest.raises(ValueError, match=r"data.blend\[0\].pth \(did you mean data.blend\[0\].path\?\)"):
        load_config(TINY, ["--data.blend=[{pth: x, weight: 1}]"])
    with pytest.raises(ValueError, match="must be a list of mappings"):
        load_config(TINY, ["--data.blend=data/web"])


def _prepared(name, tokenizer, sha):
    return TokenSource(name, None, None, 256, {"tokenizer": tokenizer, "tokenizer_sha256": sha}, 1)


def test_sources_prepared_with_other_tokenizers_are_refused_naming_both():
    same = [_prepared("data/a", "bpe", "aaa"), _prepared("data/b", "bpe", "aaa")]
    assert str(prepared_tokenizer(same, "bpe")).endswith("data/a/tokenizer.json")
    with pytest.raises(DataFileError, match=r"data/b was prepared with the tokenizer bpe \(sha256 bbb.*aaa"):
        prepared_tokenizer([same[0], _prepared("data/b", "bpe", "bbb")], "bpe")
    with pytest.raises(DataFileError, match=r"data/a was prepared with the tokenizer byte .* data.tokenizer='gpt2'"):
        prepared_tokenizer([_prepared("data/a", "byte", None)], "gpt2")


@pytest.mark.parametrize("saved, expected", [({"seq_len": 32}, "random_windows"),
                                             ({"seq_len": 32, "sampling": "epochs"}, "epochs")])
def test_a_run_resumed_from_a_checkpoint_without_sampling_keeps_random_windows(tmp_path, saved, expected):
    step = tmp_path / "run" / "checkpoints" / "step_0000003"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"config": {"data": saved}}))
    cfg = load_config(TINY, [f"--logging.run_dir={tmp_path / 'run'}"])
    assert keep_previous_sampling(cfg, "none") is cfg  # a fresh start takes the configured sampling
    assert keep_previous_sampling(cfg, "auto").data.sampling == expected
    other = load_config(TINY)
    assert keep_previous_sampling(other, str(step)).data.sampling == expected
    assert cfg.data.sampling == other.data.sampling == "epochs"  # the validated configs are never changed
