"""Every shell command of docs/data.md runs as written, in page order, with its placeholders (`path/to/...`) filled
from small fixtures and the text read capped (a later --max-bytes wins), in a scratch working directory."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from launch import ROOT, run_command
from parallel_attention.training import train_bpe

PAGE = ROOT / "docs" / "data.md"
FENCE = re.compile(r"^```(bash|sh|shell|console)\s*$")
TEXTS = [f"document {i}: " + "some words to tokenize " * (5 + i % 13) for i in range(80)]


def documented_commands(page: Path = PAGE) -> list[str]:
    """The shell commands of `page`'s fenced blocks, comments left out."""
    commands, inside = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            inside = True
        elif line.strip().startswith("```"):
            inside = False
        elif inside and line.strip() and not line.lstrip().startswith("#"):
            commands.append(line.strip())
    return commands


@pytest.fixture
def placeholders(tmp_path) -> dict[str, str]:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "part.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in TEXTS), encoding="utf-8")
    train_bpe(iter(TEXTS), 300, tmp_path / "tokenizer_dir" / "tokenizer.json")
    code, samples = tmp_path / "code_corpus", tmp_path / "samples_of_every_source"
    code.mkdir()
    samples.mkdir()
    for i in range(20):
        (code / f"mod_{i}.py").write_text(f"def f_{i}(x):\n    return x * {i} + {i % 7}\n" * (3 + i), encoding="utf-8")
    (samples / "part.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in TEXTS[:40]))
    for i in range(10):
        (samples / f"mod_{i}.py").write_text((code / f"mod_{i}.py").read_text())
    filled = {"path/to/corpus": str(corpus), "path/to/tokenizer_dir": str(tmp_path / "tokenizer_dir"),
              "path/to/code_corpus": str(code), "path/to/samples_of_every_source": str(samples)}
    try:
        import datasets
    except ImportError:
        return filled
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(tmp_path / "hf_dataset")
    return {**filled, "path/to/hf_dataset": str(tmp_path / "hf_dataset")}


def test_the_page_has_commands():
    assert any("scripts/prepare_data.py" in c for c in documented_commands())


def test_every_command_of_the_data_page_runs(placeholders, tmp_path):
    for command in documented_commands():
        needed = set(re.findall(r"path/to/\w+", command))
        if not needed <= placeholders.keys():
            pytest.skip(f"the datasets package is missing for: {command}")
        for placeholder in needed:
            command = command.replace(placeholder, placeholders[placeholder])
        args = shlex.split(command)
        if args[:2] == ["python", "scripts/inspect_data.py"]:  # reads what the commands above prepared
            _inspect(args, tmp_path)
            continue
        assert args[:2] == ["python", "scripts/prepare_data.py"], f"not run by this test: {command}"
        run = run_command([sys.executable, str(ROOT / args[1]), *args[2:], "--max-bytes", "200000"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (command, run.stderr)
        out = tmp_path / args[args.index("--out") + 1]
        assert json.loads((out / "meta.json").read_text())["num_documents"] > 0, command


def _inspect(args: list[str], work: Path) -> None:
    """inspect_data.py as documented (the config from the repository): one line per row of each step asked."""
    args = [str(ROOT / a) if a.startswith("configs/") else a for a in args]
    run = run_command([sys.executable, str(ROOT / args[1]), *args[2:]], cwd=work, capture_output=True, text=True,
                      timeout=300)
    assert run.returncode == 0, (args, run.stderr)
    lines = run.stdout.splitlines()
    assert lines and all(line.startswith("step ") and " source " in line for line in lines), run.stdout[:2000]
