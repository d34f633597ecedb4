"""What the ZeRO-1 and ZeRO-3 tests share: training steps, the two-rank checkpoint scenario's launch, and the
checks every such scenario must pass (the same losses on every rank, an exact resume, a resharded run back)."""

from __future__ import annotations

import pytest
from distributed import run_distributed

from parallel_attention.training.trainer import train_step


def train_steps(run, n: int) -> list[float]:
    """The losses of the next n training steps of `run`."""
    return [train_step(run)["loss"] for _ in range(n)]


def run_checkpoint_scenario(worker, data_dir, tmp_path_factory, name: str):
    """worker(data_dir, tmp) on two ranks (p = 1, dp = 2) in a fresh directory: (per-rank results, the directory)."""
    tmp = tmp_path_factory.mktemp(name)
    return run_distributed(worker, 2, 1, data_dir, tmp), tmp


def check_resumes_and_reshards(ranks: list[dict], keys: tuple[str, ...]) -> dict:
    """Rank 0's losses under `keys` ("a": 4 steps with a checkpoint at 2, "a_resumed": steps 3-4 again from it,
    "d": step 4 resharded back from another layout), once every rank is seen to log the same ones."""
    got = {k: ranks[0][k] for k in keys}
    assert all({k: r[k] for k in got} == got for r in ranks)  # every rank logs the same mean loss
    assert got["a_resumed"] == got["a"][2:]  # bit-exact: same shards, moments, data and float operations
    # a resharded run sums the same products in another order (float32)
    assert got["d"] == pytest.approx(got["a"][3:], rel=1e-5)
    return got
