"""The data walk stays short and never turns back (docs/architecture.md, "data/"): following one batch from a
prepared data directory (or a Megatron-LM prefix) to the micro-batches the loss reads enters at most 10 modules of
parallel_attention.training, each from one module only; the preparation check enters each of its modules from one
module only too."""

import sys

from launch import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from data_walk import walks  # noqa: E402


def test_the_data_walk_enters_few_modules_and_returns_to_none(tmp_path, capsys):
    found = walks(tmp_path)
    for title, (order, callers) in found.items():
        again = {name: entered_from for name, entered_from in callers.items() if len(entered_from) > 1}
        assert not again, f"{title}: modules entered from more than one module: {again}"
    for title in ("the batch walk", "the batch walk from a Megatron-LM prefix"):
        order, _ = found[title]
        assert "parallel_attention.training.data.read.batches" in order  # the walk did read a batch
        assert len(order) <= 10, f"{title} enters {len(order)} modules: {order}"
