"""FP8 beside mixture-of-experts layers: the attention's and the shared expert's linears run in FP8, the experts'
grouped matmuls and the router stay in their precision (docs/fp8.md), and with global scales an ep 2 layout (the
experts split over the two data-parallel ranks) trains as one process does in FP8."""

from __future__ import annotations

import pytest

from distributed import run_distributed
from test_moe_training import STEPS, _train_worker, data_dir, moe_overrides  # noqa: F401  (data_dir: a fixture)

FP8 = ("--training.fp8=tensorwise", "--training.fp8_global_scales=true")


def test_fp8_with_experts_at_ep2_trains_like_one_process(data_dir, tmp_path):
    (one,) = run_distributed(_train_worker, 1, 1, moe_overrides(data_dir, tmp_path / "one", *FP8))
    (plain,) = run_distributed(_train_worker, 1, 1, moe_overrides(data_dir, tmp_path / "plain"))
    ranks = run_distributed(_train_worker, 2, 1, moe_overrides(
        data_dir, tmp_path / "ep2", *FP8, "--parallel.expert_parallel_size=2", "--parallel.zero_stage=0"))
    expected = one["records"]
    assert [r["loss"] for r in expected] != [r["loss"] for r in plain["records"]]  # FP8 did run
    for rank, got in enumerate(ranks):
        for step, (mine, reference) in enumerate(zip(got["records"], expected)):
            for key in ("loss", "grad_norm", "moe_aux_loss", "moe_load/0"):
                assert mine[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), f"rank {rank} {key} {step}"
        assert got["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
    assert len(expected) == STEPS
