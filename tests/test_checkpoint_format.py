"""Checkpoint format 2 reorders each rank's fused QKV rows; format-1 checkpoints still load, bit-exactly.

Format 1 held a rank's fused rows per query group, [q heads | k | v] per k/v head; format 2 holds
[all its q heads | its k heads | its v heads], so that q, k and v are plain views of the projection.
Here a format-2 checkpoint is rewritten as format 1 (the per-group order built independently in the
test, optimizer moments included) and loaded back: exactly (same p), through the canonical state
dict, and resharded. GQA 8/4 so that at p = 1 and p = 2 a rank holds several groups of several queries
(with one group per rank the two orders coincide: tests/test_legacy_checkpoint.py covers that case).
Single process, no torch.distributed: a few seconds.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from parallel_attention.checkpointing import load_checkpoint, save_checkpoint
from parallel_attention.checkpointing.format import FORMAT_VERSION, MANIFEST
from parallel_attention.checkpointing.reshard import (read_canonical_checkpoint, reshard_checkpoint,
                                                      write_canonical_checkpoint)
from parallel_attention.checkpointing.tensor_io import read_safetensors, write_safetensors
from parallel_attention.tensor_parallel import manual_seed
from parallel_attention.transformer import GPTModel, ModelConfig

CFG = ModelConfig(vocab_size=64, hidden_size=48, num_layers=2, num_heads=8, num_kv_heads=4, max_seq_len=16,
                  position_embedding="rotary", activation="swiglu", norm="rmsnorm")


def _per_group_rows(shard: torch.Tensor, p: int) -> torch.Tensor:
    """Format 1's order of one rank's fused rows, from format 2's: [q_g | k_g | v_g] for each local k/v head g."""
    d = CFG.hidden_size // CFG.num_heads
    nkvl, nhl = max(CFG.num_kv_heads // p, 1), CFG.num_heads // p
    q, k, v = shard.split([nhl * d, nkvl * d, nkvl * d])
    qpg = nhl // nkvl
    parts = []
    for g in range(nkvl):
        parts += [q[g * qpg * d:(g + 1) * qpg * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    return torch.cat(parts)


def _rewrite_as_format_1(step_dir, p: int) -> None:
    """Turn a format-2 checkpoint into the format-1 checkpoint of the same state (files, manifest, hashes)."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    for name in list(manifest["files"]):
        if not name.startswith(("model_", "optim_")):
            continue
        tensors, meta = read_safetensors(step_dir / name)
        tensors = {k: _per_group_rows(t, p) if "query_key_value" in k and t.dim() > 0 else t
                   for k, t in tensors.items()}
        manifest["files"][name] = write_safetensors(step_dir / name, {k: t.contiguous() for k, t in tensors.items()},
                                                    meta or None)
    manifest["format_version"] = 1
    (step_dir / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _trained(seed: int = 0):
    manual_seed(seed)
    model = GPTModel(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, CFG.vocab_size, (2, 12))
    model(tokens, tokens).backward()
    opt.step()
    return model, opt


def test_format_2_is_written():
    assert FORMAT_VERSION == 2


def test_a_format_1_checkpoint_loads_exactly(tmp_path):
    model, opt = _trained()
    config = {"model": dataclasses.asdict(CFG), "parallel": {"tensor_parallel_size": 1}}
    step_dir = save_checkpoint(tmp_path, 1, model, opt, config=config, extra={}, keep_last=None)
    _rewrite_as_format_1(step_dir, 1)
    qkv = "layers.0.attention.query_key_value.weight"
    assert not torch.equal(read_safetensors(step_dir / "model_tp00.safetensors")[0][qkv], model.state_dict()[qkv])

    fresh, fresh_opt = _trained(seed=1)
    load_checkpoint(step_dir, fresh, fresh_opt)
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    for param, fresh_param in zip(model.parameters(), fresh.parameters()):
        for key, value in opt.state[param].items():
            assert torch.equal(fresh_opt.state[fresh_param][key], value), key
    canonical = read_canonical_checkpoint(step_dir)[1]
    assert all(torch.equal(canonical[k], v) for k, v in model.canonical_state_dict().items())


@pytest.mark.parametrize("p, to_p", [(2, 1), (1, 2)])
def test_a_format_1_checkpoint_reshards(tmp_path, p, to_p):
    model, _ = _trained()
    canonical = model.canonical_state_dict()
    run_config = {"model": dataclasses.asdict(CFG), "parallel": {"tensor_parallel_size": p}}
    step_dir = write_canonical_checkpoint(tmp_path / "src", run_config, canonical, step=3)
    _rewrite_as_format_1(step_dir, p)
    back = read_canonical_checkpoint(step_dir)[1]
    assert back.keys() == canonical.keys()
    assert all(torch.equal(back[k], v) for k, v in canonical.items())
    resharded = reshard_checkpoint(step_dir, tmp_path / "out", to_p)
    assert json.loads((resharded / MANIFEST).read_text())["format_version"] == FORMAT_VERSION
    assert all(torch.equal(read_canonical_checkpoint(resharded)[1][k], v) for k, v in canonical.items())
