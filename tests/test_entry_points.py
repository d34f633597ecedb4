"""What a user meets before any work starts: every script's --help shows its defaults, and setup.py takes the
version from parallel_attention/version.py (as text: no import of the package, which needs torch)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys

import pytest

from launch import ROOT

HELP = {  # the script, its arguments before --help, the defaults its help must show
    "pretrain.py": ([], ["default: configs/gpt_tiny.yaml", "default: the config's checkpoint.resume"]),
    "generate.py": ([], ["default: 100", "default: 0.8", "default: 40", "sampling seed (default: 0)",
                         "default: the run's parallel.timeout_s"]),
    "prepare_data.py": ([], ["default: stdlib", "default: byte", "default: data/stdlib_byte", "default: 0.02",
                             "default: all of a corpus; 8000000 for stdlib", "default: 8192", "default: text",
                             "default: 0)"]),
    "convert_hf.py": (["export"], ["default: the one recorded at import"]),
}


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(HELP))
def test_help_shows_the_defaults(name, monkeypatch, capsys):
    before, defaults = HELP[name]
    argv = [*before, "--help"]
    monkeypatch.setattr(sys, "argv", [name, *argv])  # prepare_data.py reads sys.argv itself
    main = _script(name).main
    with pytest.raises(SystemExit) as exit_info:
        main() if name == "prepare_data.py" else main(argv)
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines where it likes
    missing = [d for d in defaults if d not in text]
    assert not missing, f"{name} --help lacks {missing}:\n{text}"


def test_setup_reads_the_version_from_version_py(tmp_path):
    for name in ("setup.py", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "parallel_attention").mkdir()
    (tmp_path / "parallel_attention" / "version.py").write_text('"""The version."""\n\n__version__ = "9.8.7"\n')
    result = subprocess.run([sys.executable, "setup.py", "--version"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "9.8.7"


def test_setup_py_names_no_version_of_its_own():
    assert not re.search(r"version\s*=\s*[\"']\d", (ROOT / "setup.py").read_text(encoding="utf-8"))


@pytest.mark.parametrize("argv, resume", [(["--resume", "--data.text_field=a b"], "auto"),
                                          (["--data.text_field=a b", "--resume"], "auto"),
                                          (["--resume", "RUN/checkpoints/step_2", "--data.text_field=a b"],
                                           "RUN/checkpoints/step_2")])
def test_resume_leaves_a_following_override_with_a_space_to_the_config(argv, resume):
    """argparse takes an argument with a space for a value: --resume must not swallow `--key='a b'`."""
    args, overrides = _script("pretrain.py").parse_args([*argv, "--model.num_layers=3"])
    assert args.resume == resume and overrides == ["--data.text_field=a b", "--model.num_layers=3"]


def test_inspect_data_refuses_what_pretrain_refuses_with_the_same_line(capsys, monkeypatch):
    """inspect_data.py validates the config as pretrain.py does: the same `config error:` line, exit 2."""
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun would launch pretrain.py
    bad = ["--config", str(ROOT / "configs" / "gpt_tiny.yaml"), "--training.global_batch_size=5",
           "--training.micro_batch_size=2"]
    assert _script("pretrain.py").main(bad) == 2
    said_by_pretrain = capsys.readouterr().err.strip().splitlines()[-1]
    assert _script("inspect_data.py").main([*bad, "--steps", "0:1"]) == 2
    said = capsys.readouterr().err.strip()
    assert said.startswith("config error: ") and said == said_by_pretrain
