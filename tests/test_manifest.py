"""A manifest is cross-checked against its directory and files, and a bad one falls back like a corrupt
shard: on an exact load, and on a training resume at the same layout or resharded at another.

Probes this answers: a manifest whose `step` says 100 inside step_0000006 "finished" without training;
one without `config` raised KeyError; a corrupt newest shard on the resume-at-another-layout path crashed.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from torch import nn

import parallel_attention as pa
from parallel_attention.checkpointing import (CheckpointCorruptError, load_checkpoint, load_latest_valid, read_manifest,
                                              save_checkpoint)
from parallel_attention.training.config.schema import PretrainConfig
from parallel_attention.training.optim import build_optimizer
from parallel_attention.training.run.resume import resume_from_checkpoint
from parallel_attention.transformer import ModelConfig


def _edit_manifest(step_dir: Path, edit) -> None:
    manifest = json.loads((step_dir / "manifest.json").read_text())
    edit(manifest)
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _first_shape_doubled(m: dict) -> None:
    name = sorted(m["model_shapes"]["tp00"])[0]
    m["model_shapes"]["tp00"][name]["shape"][0] *= 2


# damage done to the newest checkpoint -> what the error must say
DAMAGE = {
    "wrong_step": (lambda d: _edit_manifest(d, lambda m: m.update(step=100)), "step is 100 but the directory is"),
    "no_config": (lambda d: _edit_manifest(d, lambda m: m.pop("config")), "config is missing"),
    "no_model_section": (lambda d: _edit_manifest(d, lambda m: m["config"].pop("model")), "no 'model' section"),
    "p_disagrees": (lambda d: _edit_manifest(d, lambda m: m.update(tensor_parallel_size=4)),
                    "tensor_parallel_size=4 x data_parallel_size=1 != world_size"),
    "shapes_disagree": (lambda d: _edit_manifest(d, _first_shape_doubled), "disagrees with the manifest's model_shapes"),
    "corrupt_shard": (lambda d: _flip_byte(d / "model_tp01.safetensors"), "model_tp01.safetensors: sha256"),
}


# ---------------------------------------------------------------- one process: the exact load


@pytest.fixture
def two_steps(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    for step in (1, 2):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        save_checkpoint(tmp_path, step, model, None, config={"model": {"h": 3}, "parallel": {}}, extra={},
                        keep_last=None)
    return tmp_path, model


@pytest.mark.parametrize("damage", ["wrong_step", "no_config", "no_model_section", "p_disagrees", "shapes_disagree"])
def test_a_bad_manifest_is_named_and_loading_falls_back(two_steps, damage):
    root, model = two_steps
    apply, words = DAMAGE[damage]
    apply(root / "step_0000002")
    with pytest.raises(CheckpointCorruptError, match=words):
        load_checkpoint(root / "step_0000002", model, expected_config={"model": {"h": 3}})
    with pytest.warns(RuntimeWarning, match=words):
        assert load_latest_valid(root, model, expected_config={"model": {"h": 3}})["step"] == 1


def test_required_keys_and_types_are_named(two_steps):
    root, _ = two_steps
    _edit_manifest(root / "step_0000002", lambda m: m.update(world_size="1", files=[], extra=None))
    with pytest.raises(CheckpointCorruptError, match=r"world_size is '1', not a JSON int; extra is None, not a JSON "
                                                     r"dict; files is \[\], not a JSON dict"):
        read_manifest(root / "step_0000002")
    assert read_manifest(root / "step_0000001")["step"] == 1


def test_a_look_at_one_record_reads_without_the_cross_checks(tmp_path):
    """verify=False (the data identity before a resume, a tool's look at the config): the file is still read by
    read_manifest, upgraded to today's keys, and a missing or non-object manifest is still a CheckpointCorruptError."""
    step = tmp_path / "step_0000003"
    step.mkdir()
    with pytest.raises(CheckpointCorruptError, match="is missing"):
        read_manifest(step, verify=False)
    (step / "manifest.json").write_text(json.dumps({"config": {"parallel": {"backend": "gloo"}}, "extra": {"a": 1}}))
    assert read_manifest(step, verify=False) == {"config": {"parallel": {"distributed_backend": "gloo"}},
                                                 "extra": {"a": 1}}
    with pytest.raises(CheckpointCorruptError, match="not a"):
        read_manifest(step)  # verified: a record alone is not a checkpoint
    (step / "manifest.json").write_text("[1, 2]")
    with pytest.raises(CheckpointCorruptError, match="not a"):
        read_manifest(step, verify=False)


# ---------------------------------------------------------------- torchrun-like: the training resume

TINY = dict(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, max_seq_len=8)


def _config(root: str, tp: int) -> PretrainConfig:
    cfg = PretrainConfig(model=ModelConfig(**TINY))
    cfg.parallel.tensor_parallel_size, cfg.logging.run_dir = tp, root
    return cfg


def _write_two_checkpoints(root: str) -> None:
    """Steps 1 and 2 of a tiny GPT at tp=2, saved as the trainer saves them."""
    cfg = _config(root, 2)
    pa.manual_seed(0)
    model = pa.GPTModel(cfg.model)
    optimizer = build_optimizer(model, cfg.optimizer)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for step in (1, 2):
        optimizer.zero_grad()
        model(tokens, tokens).backward()
        pa.finalize_grads(model)
        optimizer.step()
        save_checkpoint(Path(root) / "checkpoints", step, model, optimizer, config=cfg.to_dict(), extra={},
                        keep_last=None)


def _resume_each(roots: dict[str, str], tp: int) -> dict:
    """Resume `auto` from every damaged copy; compare with an explicit resume from its step 1."""
    seen = {}
    for damage, root in roots.items():
        cfg = _config(root, tp)
        pa.manual_seed(5)
        model = pa.GPTModel(cfg.model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = resume_from_checkpoint(cfg, "auto", model, build_optimizer(model, cfg.optimizer))["step"]
        reference = pa.GPTModel(cfg.model)
        resume_from_checkpoint(cfg, str(Path(root) / "checkpoints" / "step_0000001"), reference,
                               build_optimizer(reference, cfg.optimizer))
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
        seen[damage] = (step, same, " ".join(str(w.message) for w in caught) if dist.get_rank() == 0 else None)
    return seen


@pytest.fixture(scope="module")
def damaged_runs(tmp_path_factory):
    clean = tmp_path_factory.mktemp("clean")
    run_distributed(_write_two_checkpoints, 2, 2, str(clean), timeout=120)
    roots = {}
    for damage, (apply, _) in DAMAGE.items():
        roots[damage] = str(tmp_path_factory.mktemp(damage))
        shutil.copytree(clean / "checkpoints", Path(roots[damage]) / "checkpoints")
        apply(Path(roots[damage]) / "checkpoints" / "step_0000002")
    return roots


@pytest.mark.parametrize("tp", [2, 1], ids=["exact_tp2", "resharded_tp1_dp2"])
def test_every_rank_falls_back_past_a_bad_newest_checkpoint(damaged_runs, tp):
    per_rank = run_distributed(_resume_each, 2, tp, damaged_runs, tp, timeout=180)
    for damage, (_, words) in DAMAGE.items():
        for rank, seen in enumerate(per_rank):
            step, same, _ = seen[damage]
            assert step == 1 and same, f"{damage}: rank {rank} resumed at step {step}, weights of step 1: {same}"
        assert words in per_rank[0][damage][2], (damage, per_rank[0][damage][2])
