"""Sharded checkpoints: bit-exact resume, corruption detection and fallback, atomicity, retention, refusals.

One distributed scenario per layout (world 1 / tp 1, world 2 / tp 2, world 4 / tp 2 x dp 2) trains a
small tensor-parallel net with AdamW and dropout on both generators, saves three checkpoints, resumes
a fresh model from the last and compares everything bit for bit, then corrupts a shard of the newest
checkpoint and checks that every rank falls back to the same older one. It runs once per layout
(cached) and the tests below read its observations. The single-process tests use no torch.distributed.
All comparisons are exact (torch.equal): a resumed run must not differ from one that never stopped.
"""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn

import parallel_attention as pa
from parallel_attention.checkpointing import (CheckpointCorruptError, CheckpointError, latest_checkpoint,
                                           list_checkpoints, load_checkpoint, load_latest_valid, save_checkpoint)
from parallel_attention.tensor_parallel import get_tensor_parallel_rng_state, set_tensor_parallel_rng_state, tensor_parallel_rng

H, FFN, B = 12, 20, 6  # awkward sizes: a transposed shard changes a shape instead of passing
CONFIG = {"model": {"hidden": H, "ffn": FFN}, "train": {"lr": 1e-2, "betas": [0.9, 0.95]}}
LAYOUTS = [(1, 1), (2, 2), (4, 2)]  # (world size, tensor-parallel size)


class TinyNet(nn.Module):
    """Column -> dropout (tensor-parallel generator) -> Row -> dropout (default generator) -> tied linear."""

    def __init__(self, hidden: int = H):
        super().__init__()
        self.up = pa.ColumnParallelLinear(hidden, FFN)
        self.down = pa.RowParallelLinear(FFN, hidden, input_is_parallel=True)
        self.inp, self.out = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.out.weight = self.inp.weight  # a tied weight: one storage, two state_dict entries
        self.register_buffer("scale", torch.linspace(0.5, 1.5, hidden))

    def forward(self, x):
        y = F.gelu(self.up(self.inp(x)))
        with tensor_parallel_rng("cpu"):
            y = F.dropout(y, 0.2)
        return self.out(F.dropout(self.down(y), 0.2) * self.scale)


def _build(seed: int, hidden: int = H):
    pa.manual_seed(seed)
    model = TinyNet(hidden)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _train_step(model, opt, step: int) -> torch.Tensor:
    """One step on this data-parallel rank's batch; gradients averaged over the data-parallel group."""
    dp_rank = pa.get_data_parallel_rank() if dist.is_initialized() else 0
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    x, target = torch.randn(B, H, generator=g), torch.randn(B, H, generator=g)
    opt.zero_grad()
    loss = F.mse_loss(model(x), target)
    loss.backward()
    pa.finalize_grads(model)
    if dist.is_initialized() and pa.get_data_parallel_world_size() > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad, group=pa.get_data_parallel_group())
            p.grad /= pa.get_data_parallel_world_size()
    opt.step()
    return loss.detach()


def _params(model):
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _optim_state(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


def _draws():
    with tensor_parallel_rng("cpu"):
        tp = torch.rand(4)
    return {"cpu": torch.rand(4), "tp": tp, "python": random.random()}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    return a == b


def _scenario(root: str) -> dict:
    seen = {}
    model, opt = _build(1234)
    for step in (1, 2, 3):
        _train_step(model, opt, step)
        save_checkpoint(root, step, model, opt, config=CONFIG, extra={"tokens_seen": 100 * step}, keep_last=2)
        if step == 2:
            at_step2 = _params(model)
    saved_params, saved_optim, after_save = _params(model), _optim_state(model, opt), _draws()
    loss4, params4 = _train_step(model, opt, 4), _params(model)

    fresh, fresh_opt = _build(99)
    _train_step(fresh, fresh_opt, 0)  # give it optimizer state of its own, to be overwritten
    manifest = load_checkpoint(latest_checkpoint(root), fresh, fresh_opt, expected_config={"model": CONFIG["model"]})
    seen["params"] = _same(_params(fresh), saved_params)
    seen["optim"] = _same(_optim_state(fresh, fresh_opt), saved_optim)
    seen["step_dtype"] = str(next(iter(fresh_opt.state.values()))["step"].dtype)
    seen["rng"] = _same(_draws(), after_save)
    seen["next_step"] = _same(_train_step(fresh, fresh_opt, 4), loss4) and _same(_params(fresh), params4)
    seen["extra"], seen["step"] = manifest["extra"], manifest["step"]
    seen["kept"] = [p.name for p in list_checkpoints(root)]

    dist.barrier()
    p = pa.get_tensor_model_parallel_world_size()
    victim = latest_checkpoint(root) / f"model_tp{p - 1:02d}.safetensors"
    if dist.get_rank() == 0:  # flip one byte in the middle of the last tensor-parallel rank's shard
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    dist.barrier()
    try:
        load_checkpoint(victim.parent, fresh, fresh_opt)
        seen["strict_error"] = None
    except CheckpointCorruptError as e:
        seen["strict_error"] = str(e)
    other, other_opt = _build(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen["fallback_step"] = load_latest_valid(root, other, other_opt)["step"]
    seen["fallback_params"] = _same(_params(other), at_step2)
    seen["warned"] = any("corrupt" in str(w.message) for w in caught)
    return seen


_RESULTS: dict = {}


def _run(layout, tmp_path_factory):
    """The scenario for `layout`, run once per session: (per-rank observations, checkpoint root)."""
    if layout not in _RESULTS:
        world, tp = layout
        root = tmp_path_factory.mktemp(f"ckpt_w{world}_tp{tp}")
        _RESULTS[layout] = run_distributed(_scenario, world, tp, str(root), timeout=120), root
    return _RESULTS[layout]


@pytest.fixture(scope="module", params=LAYOUTS, ids=[f"world{w}-tp{t}" for w, t in LAYOUTS])
def scenario(request, tmp_path_factory):
    return _run(request.param, tmp_path_factory)[0]


def test_resume_is_bit_exact(scenario):
    for rank, seen in enumerate(scenario):
        assert seen["params"], f"rank {rank}: parameters differ after load"
        assert seen["optim"], f"rank {rank}: AdamW state (exp_avg, exp_avg_sq, step) differs after load"
        assert seen["step_dtype"] == "torch.float32", f"rank {rank}: AdamW step dtype {seen['step_dtype']}"
        assert seen["rng"], f"rank {rank}: RNG draws after load differ from those after save"
        assert seen["next_step"], f"rank {rank}: the step after resuming differs from the uninterrupted one"
        assert seen["step"] == 3 and seen["extra"] == {"tokens_seen": 300}


def test_keep_last_keeps_exactly_the_last_two(scenario):
    assert all(seen["kept"] == ["step_0000002", "step_0000003"] for seen in scenario)


def test_corrupt_shard_is_named_and_every_rank_falls_back(scenario):
    p = {1: 1, 2: 2, 4: 2}[len(scenario)]
    for rank, seen in enumerate(scenario):
        assert seen["strict_error"] is not None and f"model_tp{p - 1:02d}.safetensors" in seen["strict_error"]
        assert "sha256" in seen["strict_error"]
        assert seen["fallback_step"] == 2 and seen["fallback_params"], f"rank {rank} did not fall back to step 2"
    assert scenario[0]["warned"]


def test_tp2_checkpoint_into_tp1_run_names_both_sizes(tmp_path_factory, restore_rng):
    _, root = _run((2, 2), tmp_path_factory)
    model, opt = _build(1)
    with pytest.raises(CheckpointError, match=r"tensor_parallel_size=2, this run uses 1 .*resharding"):
        load_checkpoint(root / "step_0000002", model, opt)


# ---------------------------------------------------------------- single process, no torch.distributed


@pytest.fixture
def restore_rng():
    """These tests draw from and restore the process-wide generators: leave them as found."""
    tp, python = get_tensor_parallel_rng_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        yield
    set_tensor_parallel_rng_state(tp)
    random.setstate(python)


@pytest.fixture
def saved(tmp_path, restore_rng):
    model, opt = _build(5)
    for step in (1, 2):
        _train_step(model, opt, step)
        save_checkpoint(tmp_path, step, model, opt, config=CONFIG, extra={}, keep_last=None)
    return tmp_path


def test_flipped_byte_and_truncation_are_named_and_nothing_is_modified(saved):
    ckpt = saved / "step_0000002"
    model, opt = _build(6)
    before = _params(model)
    shard = ckpt / "model_tp00.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"model_tp00\.safetensors: sha256 [0-9a-f]+, manifest expects"):
        load_checkpoint(ckpt, model, opt)
    optim = saved / "step_0000001" / "optim_tp00.safetensors"
    size = optim.stat().st_size
    optim.write_bytes(optim.read_bytes()[: size // 2])
    with pytest.raises(CheckpointCorruptError, match=rf"optim_tp00\.safetensors: size {size // 2} bytes, "
                                                     rf"manifest expects {size}"):
        load_checkpoint(saved / "step_0000001", model, opt)
    assert _same(_params(model), before) and not opt.state, "a failed load modified the model or optimizer"
    with pytest.warns(RuntimeWarning, match="skipping corrupt"), \
            pytest.raises(CheckpointCorruptError, match="no valid checkpoint"):
        load_latest_valid(saved, model, opt)


def test_incomplete_directories_are_ignored(saved):
    crashed = saved / "step_0000005.tmp-abc"  # a crashed save, even with a manifest inside
    crashed.mkdir()
    (crashed / "manifest.json").write_text((saved / "step_0000002" / "manifest.json").read_text())
    (saved / "step_0000009").mkdir()  # no manifest.json
    assert [p.name for p in list_checkpoints(saved)] == ["step_0000001", "step_0000002"]
    assert latest_checkpoint(saved) == saved / "step_0000002"
    with pytest.raises(CheckpointCorruptError, match="manifest.json is missing"):
        load_checkpoint(saved / "step_0000009", *_build(1))
    model, opt = _build(1)  # saving again may replace a step; another save's temporary is not its to delete
    save_checkpoint(saved, 2, model, opt, config=CONFIG, extra={"again": True}, keep_last=None)
    assert crashed.exists() and not [p for p in saved.iterdir() if ".tmp-" in p.name and p != crashed]
    assert load_checkpoint(saved / "step_0000002", *_build(2))["extra"] == {"again": True}
    assert load_latest_valid(saved / "empty", *_build(2)) is None


def test_shape_mismatch_names_the_parameter(saved):
    model, opt = _build(1, hidden=16)
    with pytest.raises(CheckpointError, match=r"'inp\.weight': checkpoint shape \(12, 12\).*model shape \(16, 16\)"):
        load_checkpoint(saved / "step_0000002", model, opt)


def test_config_and_world_size_mismatches_are_named(saved):
    ckpt = saved / "step_0000002"
    with pytest.raises(CheckpointError, match=r"model\.hidden: checkpoint 12, run 16; model\.heads: checkpoint "
                                              r"'<absent>', run 4"):
        load_checkpoint(ckpt, *_build(1), expected_config={"model": {"hidden": 16, "ffn": FFN, "heads": 4}})
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["world_size"], manifest["data_parallel_size"] = 4, 4
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"world_size=4 \(data_parallel_size=4\), this run has world_size=1"):
        load_checkpoint(ckpt, *_build(1))


def test_failed_save_leaves_nothing_and_missing_optimizer_state_is_named(tmp_path, restore_rng):
    model, _ = _build(1)
    _, foreign_opt = _build(2)  # an optimizer over another model's parameters: their names are unknown
    with pytest.raises(CheckpointError, match=r"saving step 1 .* failed: rank 0: ValueError: the optimizer holds"):
        save_checkpoint(tmp_path, 1, model, foreign_opt, config={}, extra={}, keep_last=1)
    assert list(tmp_path.iterdir()) == [], "a failed save left a directory behind"
    save_checkpoint(tmp_path, 1, model, None, config={}, extra={}, keep_last=1)
    model, opt = _build(3)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_checkpoint(tmp_path / "step_0000001", model, opt)
    assert load_checkpoint(tmp_path / "step_0000001", model)["step"] == 1


def test_a_missing_checkpoint_directory_is_named_as_missing(tmp_path):
    """A typo in a path (convert_hf export, reshard --in, generate) says the directory does not exist and who
    writes it, not only that no checkpoint lies under it."""
    from parallel_attention.checkpointing.checkpoint import resolve_step_dir

    with pytest.raises(CheckpointError, match="quickstrat: no such directory.*pretraining writes"):
        resolve_step_dir(tmp_path / "runs" / "quickstrat")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint under"):
        resolve_step_dir(tmp_path / "empty")
