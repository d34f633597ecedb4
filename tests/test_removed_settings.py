"""Settings removed in 0.2 keep working for one release where they changed nothing, and are refused by name where
they did: parallel.comm_chunks in configs and checkpoint manifests; AttentionConfig's layout fields
(sequence_parallel, overlap_comm), comm_chunks and backend, which are no dataclass fields any more."""

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


def test_attention_config_layout_fields_warn_and_still_lay_out_the_block():
    with pytest.warns(FutureWarning) as warned:
        cfg = pa.AttentionConfig(hidden_size=16, num_heads=4, sequence_parallel=True, overlap_comm=False)
    assert sorted(str(w.message).split("=")[0] for w in warned) == ["AttentionConfig(overlap_comm",
                                                                      "AttentionConfig(sequence_parallel"]
    assert "sequence_parallel" not in {f.name for f in dataclasses.fields(cfg)}
    assert cfg == pa.AttentionConfig(hidden_size=16, num_heads=4)  # the shape is all a config compares
    module = pa.ParallelSelfAttention(cfg)
    assert module.sequence_parallel and not module.query_key_value.overlap_comm
    assert not pa.ParallelSelfAttention(cfg, sequence_parallel=False).sequence_parallel  # the argument wins


def test_attention_config_backend_and_comm_chunks():
    with pytest.warns(FutureWarning, match="attention_kernel"):
        assert pa.AttentionConfig(hidden_size=16, num_heads=4, backend="math").attention_kernel == "math"
    with pytest.warns(FutureWarning, match="comm_chunks"):
        pa.AttentionConfig(hidden_size=16, num_heads=4, comm_chunks=1)
    with pytest.raises(ValueError, match="comm_chunks=4: the key was removed"):
        pa.AttentionConfig(hidden_size=16, num_heads=4, comm_chunks=4)


def test_the_layers_take_no_comm_chunks():
    with pytest.raises(TypeError, match="comm_chunks"):
        pa.RowParallelLinear(8, 8, comm_chunks=2)
    x = torch.randn(3, 2, 8)
    assert pa.RowParallelLinear(8, 8)(x).shape == (3, 2, 8)
