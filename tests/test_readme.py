"""Every shell command in the README runs as written (shortened where it trains), in README order.

A command is either run, or exempt with its reason in EXEMPT. A new README command that matches
neither fails `test_every_readme_command_is_run_or_exempt`, so no documented command can break
unnoticed. Placeholders (`path/to/...`) are filled from fixtures where one exists.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launch import ROOT
from parallel_attention.training import train_bpe

README = ROOT / "README.md"
FENCE = re.compile(r"^```(bash|sh|shell|console)\s*$")

# pattern -> why the command is not run here
EXEMPT = {
    r"^pip install\b": "installs packages: CI runs the install itself, in a fresh venv",
    r"python -m pytest": "the test command itself (this test runs inside it)",
    r"\bsbatch\b": "needs a Slurm cluster: tests/test_slurm.py runs the sbatch script with a fake srun",
    r"HOST:PORT|NODE_RANK|<[a-z_]+>": "multi-node placeholders no fixture can fill: test_pretrain.py runs two local agents",
}
# extra arguments that keep a command short: training steps, corpus size, benchmark sizes
SHORTEN = {
    r"scripts/pretrain\.py": ["--training.max_steps=2", "--training.eval_interval=2", "--checkpoint.interval=2",
                              "--training.eval_batches=1", "--data.max_bytes=300000", "--logging.progress_bar=false"],
    r"scripts/benchmark_attention\.py": ["--case", "tiny=32,2,64,4,2", "--iters", "1", "--warmup", "0"],
    r"scripts/prepare_data\.py": ["--max-bytes", "200000"],
    # two prompts past the 128-token window cost 50 s of CPU at 300 tokens; 140 still slides the window
    r"--max-new-tokens 300": ["--max-new-tokens", "140"],
    r"--max-new-tokens 200": ["--max-new-tokens", "24"],  # the quick start's sample: its length proves nothing
}


def readme_commands() -> list[str]:
    """The lines of the README's shell blocks, in order (comments and blank lines dropped)."""
    commands, inside = [], False
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            inside = bool(FENCE.match(line)) and not inside
            continue
        if inside and line.strip() and not line.lstrip().startswith("#"):
            commands.append(line.strip())
    return commands


def _exempt_reason(command: str) -> str | None:
    return next((reason for pattern, reason in EXEMPT.items() if re.search(pattern, command)), None)


def runnable_part(command: str) -> str | None:
    """The command without its leading install steps (`pip install ... && ...`); None if nothing is left."""
    parts = [p.strip() for p in command.split("&&")]
    while parts and _exempt_reason(parts[0]) is not None:
        parts.pop(0)
    return " && ".join(parts) if parts and _exempt_reason(" && ".join(parts)) is None else None


def shortened(command: str, fixtures: dict[str, str]) -> str:
    for placeholder, value in fixtures.items():
        command = command.replace(placeholder, value)
    for pattern, extra in SHORTEN.items():
        if re.search(pattern, command):
            command += " " + " ".join(shlex.quote(e) for e in extra)
    return command


def test_commands_are_one_line_each():
    text = README.read_text(encoding="utf-8").splitlines()
    continued = [line for line in text if line.rstrip().endswith("\\") and not line.lstrip().startswith("#")]
    assert not continued, continued


def test_every_readme_command_is_run_or_exempt():
    commands = readme_commands()
    assert commands, "no shell commands found in the README"
    for command in commands:
        assert runnable_part(command) is not None or _exempt_reason(command.split("&&")[-1].strip()), command
        leftover = re.findall(r"path/to/[\w./-]+", runnable_part(command) or "")
        assert all(p in FIXTURE_PLACEHOLDERS for p in leftover), f"no fixture fills {leftover} in: {command}"


FIXTURE_PLACEHOLDERS = ("path/to/llama_dir", "path/to/llama_export", "path/to/corpus")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A scratch working directory with the repo's scripts and configs, and the placeholder fixtures."""
    work = tmp_path_factory.mktemp("readme")
    for name in ("scripts", "configs"):
        (work / name).symlink_to(ROOT / name)
    fixtures = {"path/to/llama_export": str(work / "llama_export"), "path/to/corpus": str(_corpus(work))}
    transformers = pytest.importorskip("transformers")
    llama = work / "llama_dir"
    llama.mkdir()  # a Llama with its own tokenizer, as save_pretrained leaves them side by side
    texts = (p.read_text() for p in sorted(Path(fixtures["path/to/corpus"]).iterdir()))
    tokenizer = train_bpe(texts, 300, llama / "tokenizer.json")
    config = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, eos_token_id=tokenizer.eot_token)
    transformers.LlamaForCausalLM(config).save_pretrained(llama)
    fixtures["path/to/llama_dir"] = str(llama)
    return work, fixtures


def _corpus(work: Path) -> Path:
    corpus = work / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "tensor parallel attention. " * 200)
    return corpus


def test_readme_commands_run(workspace):
    work, fixtures = workspace
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in filter(None, map(runnable_part, readme_commands())):
        run = shortened(command, fixtures)
        result = subprocess.run(["bash", "-c", run], cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"README command failed: {run}\n--- stderr ---\n{result.stderr[-4000:]}"
