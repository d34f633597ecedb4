"""Settings removed in 0.2: parallel.comm_chunks still loads from configs and checkpoint manifests where it changed
nothing (checkpointing/compatibility.py) and is refused by name where it did; AttentionConfig's keywords of before 0.2
(sequence_parallel, overlap_comm, comm_chunks, backend), accepted with a FutureWarning for the one release 0.2, are
refused by name since 0.3, with what replaces each."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import parallel_attention as pa
from parallel_attention.training.config.schema import config_from_dict, load_config, save_config


def _yaml(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_comm_chunks_1_loads_with_a_warning(tmp_path):
    with pytest.warns(FutureWarning, match="parallel.comm_chunks was removed"):
        cfg = load_config(_yaml(tmp_path, "parallel:\n  comm_chunks: 1\n  tensor_parallel_size: 2\n"))
    assert cfg.parallel.tensor_parallel_size == 2 and not hasattr(cfg.parallel, "comm_chunks")


@pytest.mark.parametrize("value", [2, 8])
def test_any_other_comm_chunks_is_refused_naming_the_key(tmp_path, value):
    with pytest.raises(ValueError, match=rf"parallel.comm_chunks={value}: the key was removed"):
        load_config(_yaml(tmp_path, f"parallel:\n  comm_chunks: {value}\n"))
    with pytest.raises(ValueError, match=rf"parallel.comm_chunks={value}: the key was removed"):
        load_config(None, [f"--parallel.comm_chunks={value}"])


def test_a_checkpoint_manifest_with_comm_chunks_loads_silently(tmp_path):
    """Every manifest written before 0.2 holds parallel.comm_chunks: 1; the user cannot edit it."""
    save_config(load_config(None), tmp_path / "config.yaml")
    data = load_config(tmp_path / "config.yaml")
    saved = dataclasses.asdict(data)
    saved["parallel"]["comm_chunks"] = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config_from_dict(saved) == data


@pytest.mark.parametrize("name,value,fix", [("sequence_parallel", True, "to ParallelSelfAttention"),
                                            ("overlap_comm", False, "to ParallelSelfAttention"),
                                            ("backend", "math", "attention_kernel="),
                                            ("comm_chunks", 1, "drop it")])
def test_attention_config_refuses_the_keywords_of_before_0_2_by_name(name, value, fix):
    """0.2 accepted them with a FutureWarning for one release; 0.3 refuses each, naming it and what replaces it."""
    with pytest.raises(TypeError, match=rf"AttentionConfig\({name}=\.\.\.\) was removed in 0\.3: .*{fix}"):
        pa.AttentionConfig(hidden_size=16, num_heads=4, **{name: value})


def test_the_layout_is_the_attention_modules():
    cfg = pa.AttentionConfig(hidden_size=16, num_heads=4)
    assert "sequence_parallel" not in {f.name for f in dataclasses.fields(cfg)}
    module = pa.ParallelSelfAttention(cfg, sequence_parallel=True, overlap_comm=False)
    assert module.sequence_parallel and not module.query_key_value.overlap_comm
    assert not pa.ParallelSelfAttention(cfg).sequence_parallel
    assert dataclasses.replace(cfg, qkv_bias=False).qkv_bias is False  # the refusal leaves the dataclass's own paths


def test_the_layers_take_no_comm_chunks():
    with pytest.raises(TypeError, match="comm_chunks"):
        pa.RowParallelLinear(8, 8, comm_chunks=2)
    x = torch.randn(3, 2, 8)
    assert pa.RowParallelLinear(8, 8)(x).shape == (3, 2, 8)
