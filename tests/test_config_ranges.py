"""Every numeric config field is range-checked before any process group exists; YAML is read strictly.

Each probe below was once accepted (or failed only after the process group existed, with a raw
traceback): now `validate` refuses it with a ConfigError naming the dotted key, the value and the fix.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from parallel_attention import load_config
from parallel_attention.training import ConfigError, PretrainConfig, train
from parallel_attention.training.config.checks import RANGES, numeric_fields
from launch import run_command

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "gpt_tiny.yaml"
AT_P1 = ["--parallel.tensor_parallel_size=1"]  # world size 1: only the probe can be wrong


def refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [*AT_P1, *overrides]).validate(1)
    return str(info.value)


@pytest.mark.parametrize("override", [
    "model.ffn_hidden_size=0", "model.ffn_hidden_size=-4", "model.norm_eps=0", "model.norm_eps=-1e-5",
    "optimizer.lr=-0.001", "optimizer.lr=.nan", "optimizer.lr=.inf", "optimizer.min_lr=-1",
    "optimizer.beta1=1.0", "optimizer.beta1=-0.1", "optimizer.beta2=1.5", "optimizer.eps=0",
    "optimizer.grad_clip=-1", "optimizer.weight_decay=-0.1", "schedule.warmup_steps=-1",
    "training.eval_batches=0", "training.max_steps=0", "training.seed=-1", "parallel.timeout_s=0",
    "parallel.timeout_s=.nan", "checkpoint.keep_last=0", "data.val_fraction=1.0", "data.max_bytes=0",
    "model.hidden_dropout=1.0", "model.num_kv_heads=0", "model.head_dim=-2", "model.init_std=0",
    "model.rope_theta=-1", "data.bpe_vocab_size=100",
])
def test_out_of_range_values_are_refused_naming_key_value_and_fix(override):
    key, value = override.split("=")
    message = refusal([f"--{override}"])
    assert f"{key}=" in message and "out of range" in message and f"--{key}=VALUE" in message, message
    parsed = load_config(TINY, [f"--{override}"])
    section, name = key.split(".")
    assert f"{key}={getattr(getattr(parsed, section), name)!r}" in message


@pytest.mark.parametrize("override", ["optimizer.lr=1e6", "optimizer.grad_clip=0", "schedule.warmup_steps=0",
                                      "model.ffn_hidden_size=null", "data.max_bytes=null",
                                      "optimizer.lr=0 --optimizer.min_lr=0", "training.audit_interval=0", "checkpoint.resume=none"])
def test_meaningful_edges_are_accepted(override):
    # a huge lr is the user's call; 0 disables clipping; null takes the documented default
    load_config(TINY, [*AT_P1, *f"--{override}".split()]).validate(1)


def test_every_numeric_field_has_exactly_one_range():
    assert set(numeric_fields(PretrainConfig())) == set(RANGES)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  hidden_size: 64\n  num_heads: [4, 8\ndata:\n  seq_len: 32\n")
    with pytest.raises(ValueError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "line " in str(info.value) and "fix the YAML" in str(info.value)


@pytest.mark.parametrize("text,line", [("optimizer:\n  lr: 0.1\n  lr: 0.2\n", 3),
                                       ("model:\n  num_layers: 2\ntraining:\n  seed: 1\nmodel:\n  num_layers: 3\n", 5)])
def test_duplicate_keys_are_refused_with_file_and_line(tmp_path, text, line):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message and f"line {line}" in message and "duplicate key" in message, message


def test_an_override_with_bad_yaml_names_the_override():
    with pytest.raises(ValueError, match=r"override '--model.num_heads=\[4'"):
        load_config(TINY, ["--model.num_heads=[4"])


def test_checkpoint_resume_must_be_auto_none_or_a_step_directory(tmp_path):
    assert "does not exist" in refusal([f"--checkpoint.resume={tmp_path / 'step_0000007'}"])
    assert "has no manifest.json" in refusal([f"--checkpoint.resume={tmp_path}"])
    (tmp_path / "manifest.json").write_text("{}")
    load_config(TINY, [*AT_P1, f"--checkpoint.resume={tmp_path}"]).validate(1)


def test_a_missing_data_source_is_refused(tmp_path):
    message = refusal([f"--data.source={tmp_path / 'corpus.txt'}"])
    assert "data.source=" in message and "does not exist" in message and "'stdlib'" in message


def test_resume_argument_is_checked_before_any_process_group(monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="--resume="):
        train(load_config(TINY, AT_P1), resume=str(tmp_path / "nowhere"))
    assert not torch.distributed.is_initialized()


def test_pretrain_script_says_config_error_without_a_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    done = run_command([sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--config", str(TINY), *AT_P1,
                        "--resume", str(tmp_path / "step_0000001")], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and "config error: --resume=" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
