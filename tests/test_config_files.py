"""A damaged config file (cut short, control characters, not UTF-8) comes out of scripts/pretrain.py as one
`config error:` line that names the file, with exit status 2, before any process group exists."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from launch import ROOT, run_command

GOOD = (ROOT / "configs" / "gpt_tiny.yaml").read_bytes()
DAMAGED = {  # name -> (bytes of the file, what the line must say after the file name)
    "truncated": (GOOD[: GOOD.index(b"\n", len(GOOD) // 2)] + b"\n  layers: [1, 2", ", line "),
    "garbage": (b"model:\n  hidden_size: 3\x002\n", ", line 2, column 17: unacceptable character #x0000"),
    "not_utf8": (b"model:\n  hidden_size: \xff\xfe\n", ": byte 22 (b'\\xff') is not UTF-8"),
}


def _pretrain_main():
    spec = importlib.util.spec_from_file_location("pretrain_entry", ROOT / "scripts" / "pretrain.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    return entry.main


@pytest.mark.parametrize("name", DAMAGED)
def test_a_damaged_config_is_one_line_naming_the_file(name, tmp_path, monkeypatch, capsys):
    data, said = DAMAGED[name]
    path = tmp_path / "damaged.yaml"
    path.write_bytes(data)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _pretrain_main()(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"config error: {path}{said}"), err
    assert not torch.distributed.is_initialized()


def test_a_non_utf8_config_exits_2_from_the_script_without_a_traceback(tmp_path):
    (tmp_path / "latin1.yaml").write_bytes("model:\n  # d\u00e9faut\n  hidden_size: 32\n".encode("latin-1"))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    done = run_command([sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--config", "latin1.yaml"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines() == ["config error: latin1.yaml: byte 12 (b'\\xe9') is not UTF-8: a config is "
                                        "UTF-8 text; save it as such (is it the file you meant?)."]
