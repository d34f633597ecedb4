"""Checkpoints written by earlier releases keep loading.

tests/data/legacy_v0_1_0 holds step 3 of a 6-step run (Llama-style: GQA 4/2, rotary, RMSNorm,
SwiGLU, untied head; tensor_parallel_size 2) written by parallel_attention 0.1.0, with the losses
and gradient norms that run logged for steps 4 to 6. Resuming it with today's code must continue
exactly at the same layout, and through resharding at p = 1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from launch import ROOT, metrics, torchrun
from parallel_attention.training.data.token_files import SHA_CACHE

LEGACY = ROOT / "tests" / "data" / "legacy_v0_1_0"


def _resume(tmp_path: Path, world: int, tp: int) -> list[dict]:
    expected = json.loads((LEGACY / "expected.json").read_text())
    run = tmp_path / f"run_p{tp}"
    shutil.copytree(LEGACY / "checkpoints", run / "checkpoints")
    torchrun("pretrain.py", world, ["--config", str(ROOT / "configs" / "gpt_tiny.yaml"), *expected["overrides"],
                                    f"--data.source={LEGACY / 'corpus.txt'}", f"--data.data_dir={tmp_path / 'data'}",
                                    f"--parallel.tensor_parallel_size={tp}", f"--logging.run_dir={run}"])
    return [r for r in metrics(run) if "loss" in r]


def test_a_v0_1_0_checkpoint_resumes_exactly_at_its_layout(tmp_path):
    expected = json.loads((LEGACY / "expected.json").read_text())
    rows = _resume(tmp_path, 2, 2)
    assert [r["step"] for r in rows] == [4, 5, 6]
    for r in rows:  # same layout, same RNG and data position: the same float operations
        assert r["loss"] == expected["losses"][str(r["step"])], r["step"]
        assert r["grad_norm"] == pytest.approx(expected["grad_norms"][str(r["step"])], rel=1e-6), r["step"]


def test_a_v0_1_0_checkpoint_reshards_to_p1(tmp_path):
    expected = json.loads((LEGACY / "expected.json").read_text())
    rows = _resume(tmp_path, 1, 1)
    assert [r["step"] for r in rows] == [4, 5, 6]
    for r in rows:  # another p sums the same products in another order (no dropout: RNG does not matter)
        assert r["loss"] == pytest.approx(expected["losses"][str(r["step"])], rel=1e-5), r["step"]


LEGACY_0_2 = ROOT / "tests" / "data" / "legacy_v0_2_0"


def test_a_v0_2_0_run_and_data_directory_resume_with_the_batches_and_losses_of_that_release(tmp_path):
    """0.2.0 drew random windows from train.bin (there was no data.sampling) and wrote a data directory of
    train/val .bin files: resumed by today's code with the same command, the run keeps drawing them from the same
    data directory, and steps 4 to 6 and their validation loss are the ones 0.2.0 logged, to the bit."""
    expected = json.loads((LEGACY_0_2 / "expected.json").read_text())
    run, data = tmp_path / "run", tmp_path / "data"
    shutil.copytree(LEGACY_0_2 / "checkpoints", run / "checkpoints")
    shutil.copy(LEGACY_0_2 / "config.yaml", run / "config.yaml")
    shutil.copytree(LEGACY_0_2 / "data", data)
    corpus = LEGACY / "corpus.txt"
    meta = json.loads((data / "meta.json").read_text())
    meta["source"] = str(corpus.resolve())  # where this checkout holds the corpus it was prepared from
    (data / "meta.json").write_text(json.dumps(meta, indent=2))
    result = torchrun("pretrain.py", 1, ["--config", str(ROOT / "configs" / "gpt_tiny.yaml"), *expected["overrides"],
                                         f"--data.source={corpus}", f"--data.data_dir={data}",
                                         f"--logging.run_dir={run}"])
    assert "data.sampling: random_windows" in result.stderr
    rows = metrics(run)
    assert [r["step"] for r in rows if "loss" in r] == [4, 5, 6]
    for r in rows:
        if "loss" in r:  # same layout, same RNG, same windows of the same file: the same float operations
            assert r["loss"] == expected["losses"][str(r["step"])], r["step"]
            assert r["grad_norm"] == expected["grad_norms"][str(r["step"])], r["step"]
        if "val_loss" in r:
            assert r["val_loss"] == expected["val_losses"][str(r["step"])], r["step"]
    # nothing rewritten: the directory holds what 0.2.0 wrote, and the hash cache
    assert {p.name for p in data.iterdir()} == {p.name for p in (LEGACY_0_2 / "data").iterdir()} | {SHA_CACHE}
    assert all((data / p.name).read_bytes() == p.read_bytes() for p in (LEGACY_0_2 / "data").glob("*.*")
               if p.name != "meta.json")
