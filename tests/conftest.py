"""Collection order for the two xdist workers, and the fixtures that several test files share.

Collection order (`--dist loadfile`: each file runs whole on one worker): files go to the workers in collection
order, so a long file collected last leaves the other worker idle while it runs. The longest files (measured
with --durations) are collected first; the rest keep their order. Only the order changes, never which tests run.

Shared fixtures (tests/tiny_run.py): the prepared data and a finished reference run, made once per session for
both workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tiny_run import make_reference, once, prepare, session_dir

LONGEST_FIRST = ("test_readme.py", "test_pretrain.py", "test_hf_convert.py", "test_reshard.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest keep their order


@dataclass(frozen=True)
class Reference:
    """The reference run (tiny_run.reference_args) and what its launch printed. Read it; change a copy."""

    run: Path
    stdout: str
    stderr: str


@pytest.fixture(scope="session")
def shared_data(tmp_path_factory) -> Path:
    """stdlib sources prepared with the byte tokenizer (tiny_run.MAX_BYTES of text), once per session."""
    return once(session_dir(tmp_path_factory), "data", prepare)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, shared_data) -> Reference:
    path = once(session_dir(tmp_path_factory), "reference", lambda p: make_reference(shared_data, p))
    return Reference(path / "run", (path / "stdout.txt").read_text(encoding="utf-8"),
                     (path / "stderr.txt").read_text(encoding="utf-8"))
