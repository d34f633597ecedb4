"""Collection order for the two xdist workers (`--dist loadfile`: each file runs whole on one worker).

Files go to the workers in collection order, so a long file collected last leaves the other worker idle while it
runs. The longest files (measured with --durations: the README commands alone take about 200 s) are collected
first; the rest keep their order. Only the order changes, never which tests run.
"""

from __future__ import annotations

LONGEST_FIRST = ("test_readme.py", "test_pretrain.py", "test_hf_convert.py", "test_reshard.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest keep their order
