"""Warnings print as one line each, without the source line under them, in every entry point that calls
`one_line_warnings()` first (pretrain.py, convert_hf.py, the self-check)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings

from launch import ROOT, environment

_WARN = """
from parallel_attention.launch.warning_lines import one_line_warnings
import warnings
one_line_warnings()
warnings.warn("first line\\nsecond line", RuntimeWarning)  # a source line Python would print under it
"""


def test_a_warning_is_one_line_without_its_source_line():
    result = subprocess.run([sys.executable, "-c", _WARN], env=environment(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.endswith(": RuntimeWarning: first line second line\n") and "warnings.warn" not in result.stderr


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_entry_points_set_it_first(tmp_path, monkeypatch):
    from parallel_attention.launch.warning_lines import one_line

    default = warnings.formatwarning
    for name, argv in [("pretrain", ["--config", str(tmp_path / "missing.yaml")]),
                       ("convert_hf", ["export", "--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path)])]:
        monkeypatch.setattr(warnings, "formatwarning", default)  # Python's own, put back after the test too
        assert _script(name).main(argv) == 2  # refused at once: the format was set before
        assert warnings.formatwarning is one_line, name
