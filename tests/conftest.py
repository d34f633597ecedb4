"""Start the longest test files first, so that the two xdist workers finish together (CI time)."""

from __future__ import annotations

# the end-to-end files, longest first (measured with --durations on the 2-core CI machine)
LONGEST_FIRST = ("test_readme.py", "test_pretrain.py", "test_reshard.py", "test_hf_convert.py",
                 "test_dropout_invariance.py", "test_checkpoint.py", "test_guards.py", "test_generate.py",
                 "test_slurm.py", "test_check.py", "test_collective_guard.py", "test_properties.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: order within a file kept
