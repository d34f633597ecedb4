"""The README's API table lists every name of `parallel_attention.__all__` (and names nothing that is not there)."""

from __future__ import annotations

import re

import parallel_attention as pa
from launch import ROOT


def _table_names() -> set[str]:
    """The backticked names of the API table's name column, argument lists dropped, `a_{x,y}` expanded."""
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    names = set()
    for row in (line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")):
        for code in re.findall(r"`([^`]+)`", row.split("|")[2]):
            name = code.split("(", 1)[0].strip()
            braces = re.fullmatch(r"(\w+)\{([\w,]+)\}(\w*)", name)
            names |= {braces[1] + part + braces[3] for part in braces[2].split(",")} if braces else {name}
    return names


def test_the_api_table_lists_every_public_name():
    listed = _table_names()
    assert set(pa.__all__) - listed == set(), "in __all__ but not in the README's API table"
    assert listed - set(pa.__all__) == {"hf.save_pretrained"}  # a sub-package's name: pa.hf.save_pretrained
    assert callable(pa.hf.save_pretrained)
