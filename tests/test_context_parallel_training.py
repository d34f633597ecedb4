"""The trainer under context parallelism: parallel.context_parallel_size / _kind, gradients averaged over dp x cp.

A Llama-style model (4 heads / 1 k/v head, rotary, RMSNorm, SwiGLU) trained 12 steps at s = 128 by the trainer's own
build() and train_step() gives one process's losses and gradient norms at cp2 ring and cp2 all_to_all (both
cp2 x dp2 in a world of 4), cp4 ring, tp2 x cp2 (ring and all_to_all) and tp2 x cp2 + SP (ring). float32; the
layouts only reorder sums: within 1e-5 relative (the design's float32 bound, tighter than the issue's 1e-4;
measured <= 3.3e-7).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from parallel_attention.training import prepare_data
from parallel_attention.training.trainer import train_step
from test_data_parallel import build_run, overrides

STEPS, SEQ = 12, 128
LLAMA = ["--model.num_heads=4", "--model.num_kv_heads=1", "--model.activation=swiglu", "--model.norm=rmsnorm",
         "--model.position_embedding=rotary", "--model.tie_embeddings=false", f"--model.max_seq_len={SEQ}",
         f"--data.seq_len={SEQ}", "--training.global_batch_size=4", f"--training.max_steps={STEPS}"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data")
    prepare_data("stdlib", "byte", path, val_fraction=0.05, max_bytes=200_000)
    return path


def _args(data_dir, run_dir, tp, *extra):
    base = [a for a in overrides(data_dir, run_dir, tp) if not a.startswith(("--model.max_seq_len", "--data.seq_len",
                                                                            "--training.global_batch_size",
                                                                            "--training.max_steps"))]
    return base + LLAMA + list(extra)


def _history(run) -> dict:
    records = [train_step(run) for _ in range(STEPS)]
    return {key: [r[metric] for r in records] for key, metric in (("losses", "loss"), ("norms", "grad_norm"))}


def _worker(layouts):
    return {name: _history(build_run(args)) for name, args in layouts}


@pytest.mark.slow
def test_cp_layouts_train_like_one_process(data_dir, tmp_path):
    def layout(name, tp, *extra):
        return name, _args(data_dir, tmp_path / name, tp, *extra)

    (single,) = run_distributed(_worker, 1, 1, [layout("p1", 1)], timeout=600)
    cp2, ring = "--parallel.context_parallel_size=2", "--parallel.context_parallel_kind=ring"
    a2a, sp = "--parallel.context_parallel_kind=all_to_all", "--parallel.sequence_parallel=true"
    world4 = run_distributed(_worker, 4, 4, [
        layout("cp2_ring", 1, cp2, ring), layout("cp2_all_to_all", 1, cp2, a2a),
        layout("cp4_ring", 1, "--parallel.context_parallel_size=4", ring), layout("tp2_cp2_ring", 2, cp2, ring),
        layout("tp2_cp2_all_to_all", 2, cp2, a2a), layout("tp2_cp2_sp_ring", 2, cp2, ring, sp)], timeout=900)
    expected = single["p1"]
    for rank_results in world4:
        for name, got in rank_results.items():
            torch.testing.assert_close(got["losses"], expected["losses"], rtol=1e-5, atol=0, msg=name)
            torch.testing.assert_close(got["norms"], expected["norms"], rtol=1e-5, atol=0, msg=name)


@pytest.fixture(scope="module")
def documents_dir(tmp_path_factory) -> Path:
    """Packed short documents (1-200 bytes), so that every 128-token window crosses several boundaries, some of
    them inside a zigzag chunk and some on a chunk's edge."""
    root = tmp_path_factory.mktemp("cp_docs")
    g = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "pi", "x", "omega"]
    lines = [json.dumps({"text": " ".join(words[int(i)] for i in torch.randint(0, 7, (n,), generator=g))})
             for n in torch.randint(1, 40, (1500,), generator=g).tolist()]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    prepare_data(str(root / "docs.jsonl"), "byte", root / "data", val_fraction=0.1, max_bytes=None)
    return root / "data"


def test_document_masking_under_cp_trains_like_one_process_with_masking(documents_dir, tmp_path):
    """data.document_masking at cp2 (ring and all_to_all, x dp2) and tp2 x cp2 (both kinds): one process's masked
    losses and norms within 1e-5 over 12 steps at s = 128, and those differ from the unmasked run's."""
    source = [f"--data.source={documents_dir.parent / 'docs.jsonl'}", "--data.max_bytes=null"]

    def layout(name, tp, *extra):
        return name, _args(documents_dir, tmp_path / name, tp, *extra) + source

    masked, cp2 = "--data.document_masking=true", "--parallel.context_parallel_size=2"
    ring, a2a = "--parallel.context_parallel_kind=ring", "--parallel.context_parallel_kind=all_to_all"
    (single,) = run_distributed(_worker, 1, 1, [layout("p1", 1, masked), layout("p1_unmasked", 1)], timeout=600)
    world4 = run_distributed(_worker, 4, 4, [
        layout("cp2_ring", 1, cp2, ring, masked), layout("cp2_all_to_all", 1, cp2, a2a, masked),
        layout("tp2_cp2_ring", 2, cp2, ring, masked), layout("tp2_cp2_all_to_all", 2, cp2, a2a, masked)],
        timeout=900)
    expected, unmasked = single["p1"], single["p1_unmasked"]
    # masking moves the losses by more than 10x the layouts' tolerance (measured up to 4e-4 relative by step 4,
    # from the first step's 4e-5: the documents are short of the sequence, so few positions attend differently)
    assert max(abs(a - b) / abs(b) for a, b in zip(expected["losses"], unmasked["losses"])) > 1e-4, \
        (expected["losses"], unmasked["losses"])
    for rank_results in world4:
        for name, got in rank_results.items():
            torch.testing.assert_close(got["losses"], expected["losses"], rtol=1e-5, atol=0, msg=name)
            torch.testing.assert_close(got["norms"], expected["norms"], rtol=1e-5, atol=0, msg=name)


REFUSALS = [
    (4, ["--parallel.context_parallel_size=3"], "tensor_parallel_size=1 x context_parallel_size=3 does not divide "
                                                "the world size 4"),
    (4, ["--parallel.context_parallel_size=4", "--data.seq_len=12", "--model.max_seq_len=12"],
     "data.seq_len=12 divisible by 2 x context_parallel_size = 8"),
    (4, ["--parallel.context_parallel_size=2", "--parallel.tensor_parallel_size=2", "--parallel.sequence_parallel=true",
         "--data.seq_len=20", "--model.max_seq_len=20"], "x tensor_parallel_size=2 (sequence_parallel) = 8"),
    (2, ["--parallel.context_parallel_size=2", "--parallel.context_parallel_kind=ring",
         "--model.attention_dropout=0.1"], "model.attention_dropout=0.1"),
    (4, ["--parallel.context_parallel_size=4", "--parallel.context_parallel_kind=all_to_all", "--model.num_heads=2"],
     "(model.num_heads=2 / tp 1) divisible by context_parallel_size=4"),
    (2, ["--parallel.context_parallel_size=0"], "parallel.context_parallel_size=0 is out of range"),
]


@pytest.mark.parametrize("world,extra,message", REFUSALS, ids=[str(i) for i in range(len(REFUSALS))])
def test_cp_settings_are_checked_before_any_process_group(world, extra, message, tmp_path):
    from launch import ROOT

    from parallel_attention.training import ConfigError, load_config

    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", [f"--logging.run_dir={tmp_path}",
                                                           "--parallel.tensor_parallel_size=1", *extra])
    with pytest.raises(ConfigError) as error:
        cfg.validate(world)
    assert message in str(error.value)


def test_a_cp_layout_validates_and_counts_its_accumulation_steps(tmp_path):
    from launch import ROOT

    from parallel_attention.training import load_config

    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", [f"--logging.run_dir={tmp_path}", "--data.seq_len=16",
                                                           "--parallel.tensor_parallel_size=1",
                                                           "--parallel.context_parallel_size=2",
                                                           "--parallel.context_parallel_kind=all_to_all"])
    cfg.validate(4)  # dp = 4 / (tp 1 x cp 2) = 2
    assert cfg.gradient_accumulation_steps(4) == cfg.training.global_batch_size // (cfg.training.micro_batch_size * 2)
