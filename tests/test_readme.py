"""Every shell command of the README and of the docs pages runs as written (shortened where it trains or
times), in page order: the README first, then docs/*.md in DOC_PAGES order.

A command is either run here, or run as written by another test that asserts more of it (RUN_ELSEWHERE), or
exempt with its reason in EXEMPT. A new command that matches none fails
`test_every_command_is_run_or_exempt`, so no documented command can break unnoticed. A command shown on two
pages runs once. Placeholders (`path/to/...`) are filled from fixtures where one exists. The commands of the
benchmark scripts (benchmarks/) run under the `bench` marker, with the tests of those scripts
(python -m pytest -q -m bench); the README's embedding example runs under torchrun and must print.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launch import ROOT, run_command
from parallel_attention.training import train_bpe
from test_check import DOCUMENTED as CHECK_COMMANDS
from test_pipeline import DOCUMENTED_CHECK as PIPELINE_CHECK

README = ROOT / "README.md"
DOC_PAGES = ("embedding", "configuration", "training", "pipeline", "checkpoints-and-hf", "failure-modes",
             "architecture", "performance", "development")
PAGES = (README, *(ROOT / "docs" / f"{name}.md" for name in DOC_PAGES))
# pages whose commands a test of their own runs, in their own scratch directory with their own fixtures
OWN_TESTS = {"data.md": "tests/test_data_docs.py", "fp8.md": "tests/test_fp8_docs.py", "moe.md": "tests/test_moe_docs.py"}
# commands that another test runs as written and asserts more of: not launched a second time here
RUN_ELSEWHERE = {command: "tests/test_check.py" for command in CHECK_COMMANDS}
RUN_ELSEWHERE[PIPELINE_CHECK] = "tests/test_pipeline.py"
# the README's MoE recipe is docs/moe.md's first command, which that page's own test runs (and continues)
RUN_ELSEWHERE["torchrun --standalone --nproc-per-node 2 scripts/pretrain.py --config configs/moe_tiny.yaml"] = \
    "tests/test_moe_docs.py"
FENCE = re.compile(r"^```(bash|sh|shell|console)\s*$")
BENCHMARK = re.compile(r"\bbenchmarks/")

# pattern -> why the command is not run here
EXEMPT = {
    r"^pip install\b": "installs packages: CI runs the install itself, in a fresh venv",
    r"python -m pytest": "the test command itself (this test runs inside it)",
    r"\bsbatch\b": "needs a Slurm cluster: tests/test_slurm.py runs the sbatch script with a fake srun",
    r"HOST:PORT|NODE_RANK|<[a-z_]+>": "multi-node placeholders no fixture can fill: test_pretrain.py runs two local agents",
    r"tiktoken\.get_encoding": "downloads the GPT-2 BPE files: needs the network",
    r"llama_1b_tp8\.yaml": "a 1.1B model on 8 GPUs: tests/test_config.py loads and validates the config",
    r"llama_70b_pp\.yaml": "a 70B model on 128 GPUs: tests/test_config.py validates it and reads its stages' memory",
    r"gpu_check\.sh": "needs an NVIDIA GPU (it exits 2 without CUDA)",
}
# the benchmark model shrunk to a few seconds a launch (later overrides win; byte tokens: no BPE to train)
TINY_BENCH_MODEL = ["--model.hidden_size=32", "--model.num_layers=1", "--model.num_heads=4", "--model.num_kv_heads=2",
                    "--model.vocab_size=256", "--model.max_seq_len=32", "--data.seq_len=32", "--data.tokenizer=byte",
                    "--data.data_dir=data/bench_tiny", "--data.max_bytes=200000"]
# pattern -> what the command loses first: arguments that a shortening replaces (argparse appends --case)
DROP = {r"benchmarks/benchmark_attention\.py": r"\s--case\s+\S+"}
# extra arguments that keep a command short: training steps, corpus size, benchmark sizes
SHORTEN = {
    r"scripts/pretrain\.py": ["--training.max_steps=2", "--training.eval_interval=2", "--checkpoint.interval=2",
                              "--training.eval_batches=1", "--data.max_bytes=300000", "--logging.progress_bar=false"],
    r"scripts/prepare_data\.py": ["--max-bytes", "200000"],
    # the pipeline recipe's steady-state step (20 with log_interval 10), drawn at the 2 steps run here
    r"pretrain\.py .*--logging\.run_dir=runs/pp_tiny": ["--logging.log_interval=2"],
    r"scripts/pipeline_timeline\.py": ["--step", "2"],
    # two prompts past the 128-token window cost 50 s of CPU at 300 tokens; 140 still slides the window
    r"--max-new-tokens 300": ["--max-new-tokens", "140"],
    r"--max-new-tokens 200": ["--max-new-tokens", "24"],  # the quick start's sample: its length proves nothing
    r"benchmarks/benchmark_attention\.py": ["--case", "tiny=32,2,64,4,2", "--iters", "1", "--warmup", "0"],
    r"benchmarks/benchmark_training\.py": [*TINY_BENCH_MODEL, "--no-baselines", "--iters", "1", "--warmup", "0"],
    r"benchmarks/benchmark_scaling\.py": [*TINY_BENCH_MODEL, "--rounds", "1", "--iters", "1", "--warmup", "0"],
    r"benchmarks/benchmark_preparation\.py": ["--sizes-mb", "0.2", "0.4", "--bpe-mb", "0.3", "--repeats", "1"],
    r"benchmarks/pipeline_speed\.py": ["--rounds", "1", "--steps", "3"],
    r"benchmarks/moe_step\.py": ["--rounds", "1", "--iters", "1", "--seq", "32"],
    r"benchmarks/moe_ep_speed\.py": ["--rounds", "1", "--steps", "3"],
    r"benchmarks/moe_vs_transformers\.py": ["--rounds", "1", "--iters", "1", "--tokens", "64", "--hidden", "64",
                                           "--experts", "8", "--top-k", "2", "--ffn", "32"],
    r"benchmarks/pipeline_bubble\.py": ["--stages", "2", "--micro-batches", "2", "--step-ms", "5", "--repeats", "1"],
    r"benchmarks/activation_memory\.py": ["--seq", "32", "--batch", "1", "--hidden", "64", "--heads", "4",
                                          "--kv-heads", "2"],
}


def page_commands(page: Path) -> list[str]:
    """The lines of a page's shell blocks, in order (comments and blank lines dropped)."""
    commands, inside = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            inside = bool(FENCE.match(line)) and not inside
            continue
        if inside and line.strip() and not line.lstrip().startswith("#"):
            commands.append(line.strip())
    return commands


def documented_commands() -> list[str]:
    """Every page's commands in page order, each distinct command once."""
    return list(dict.fromkeys(c for page in PAGES for c in page_commands(page)))


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
    for pattern, drop in DROP.items():
        if re.search(pattern, command):
            command = re.sub(drop, "", command)
    for pattern, extra in SHORTEN.items():
        if re.search(pattern, command):
            command += " " + " ".join(shlex.quote(e) for e in extra)
    return command


def _runnable(benchmarks: bool) -> list[str]:
    return [c for c in filter(None, map(runnable_part, documented_commands()))
            if bool(BENCHMARK.search(c)) == benchmarks and c not in RUN_ELSEWHERE]


# the most lines a page may have: detail goes to the page that owns its topic, history to git
BUDGETS = {"README.md": 250, "docs/*.md": 400}


@pytest.mark.parametrize("pattern", BUDGETS)
def test_the_pages_keep_their_line_budgets(pattern):
    pages = sorted(ROOT.glob(pattern))
    assert pages, f"no page matches {pattern}"
    over = {p.name: n for p in pages if (n := len(p.read_text(encoding="utf-8").splitlines())) > BUDGETS[pattern]}
    assert not over, f"over the budget of {BUDGETS[pattern]} lines: {over}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_commands_are_one_line_each(page):
    text = page.read_text(encoding="utf-8").splitlines()
    continued = [line for line in text if line.rstrip().endswith("\\") and not line.lstrip().startswith("#")]
    assert not continued, continued


def test_every_command_is_run_or_exempt():
    assert page_commands(README), "no shell commands found in the README"
    for page in PAGES[1:]:
        assert page.exists(), f"{page} is missing from DOC_PAGES"
    listed = {p.name for p in PAGES} | set(OWN_TESTS)
    unlisted = [p.name for p in (ROOT / "docs").glob("*.md") if p.name not in listed and page_commands(p)]
    assert not unlisted, f"docs pages with commands that no test runs: {unlisted} (add them to DOC_PAGES)"
    stale = set(RUN_ELSEWHERE) - set(documented_commands())
    assert not stale, f"RUN_ELSEWHERE lists commands that no page shows: {stale}"
    for command in documented_commands():
        assert runnable_part(command) is not None or _exempt_reason(command.split("&&")[-1].strip()), command
        leftover = re.findall(r"path/to/[\w./-]+", runnable_part(command) or "")
        assert all(p in FIXTURE_PLACEHOLDERS for p in leftover), f"no fixture fills {leftover} in: {command}"
        if BENCHMARK.search(command):  # a benchmark's command must be one that the bench test shortens
            assert any(re.search(p, command) for p in SHORTEN if p.startswith(r"benchmarks/")) or \
                "_bench_" in command, f"no SHORTEN entry for: {command}"


FIXTURE_PLACEHOLDERS = ("path/to/llama_dir", "path/to/llama_export", "path/to/corpus")


def _workspace(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A scratch working directory with the repo's scripts, benchmarks and configs, and the placeholder fixtures."""
    work = tmp_path_factory.mktemp("readme")
    for name in ("scripts", "benchmarks", "configs"):
        (work / name).symlink_to(ROOT / name)
    return work, {"path/to/llama_export": str(work / "llama_export"), "path/to/corpus": str(_corpus(work))}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    work, fixtures = _workspace(tmp_path_factory)
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


def _environment() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


# a documented `python ...` or `torchrun ...` line as this interpreter's argv (run_command forks those); None for a
# line that needs the shell
INTERPRETERS = {"python": [sys.executable], "torchrun": [sys.executable, "-m", "torch.distributed.run"]}
SHELL_SYNTAX = re.compile(r"[|&;<>$`]|^\w+=")


def _argv(command: str) -> list[str] | None:
    words = shlex.split(command)
    if words[0] not in INTERPRETERS or any(SHELL_SYNTAX.search(w) for w in shlex.split(command, posix=False)):
        return None
    return INTERPRETERS[words[0]] + words[1:]


def _run_all(commands: list[str], work: Path, fixtures: dict[str, str]) -> None:
    for command in commands:
        run = shortened(command, fixtures)
        argv = _argv(run) or ["bash", "-c", run]
        result = run_command(argv, cwd=work, env=_environment(), timeout=600)
        assert result.returncode == 0, f"documented command failed: {run}\n--- stderr ---\n{result.stderr[-4000:]}"


def test_documented_commands_run(workspace):
    _run_all(_runnable(benchmarks=False), *workspace)


@pytest.mark.bench
def test_documented_benchmark_commands_run(tmp_path_factory):
    _run_all(_runnable(benchmarks=True), *_workspace(tmp_path_factory))


def _python_example(marker: str) -> str:
    """The README's python block whose first line starts with `marker`."""
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)
    found = [b for b in blocks if b.startswith(marker)]
    assert len(found) == 1, f"expected one python block starting with {marker!r}, found {len(found)}"
    return found[0]


def test_the_embedding_example_runs_and_says_so(tmp_path):
    script = tmp_path / "my_block.py"
    script.write_text(_python_example("# my_block.py"), encoding="utf-8")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(script)]
    result = run_command(command, cwd=tmp_path, env=_environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    # Four processes share one pipe: a line's text and its newline can be separate writes, so two ranks' lines
    # may run together. Match each line by its pattern, not by splitting on newlines.
    lines = sorted(re.findall(r"rank (\d+): tp rank \d of 2, (\d) of 8 heads here, y \(128, 4, 256\), "
                              r"y\.sum\(\) (-?\d+\.\d{4})", result.stdout))
    assert [rank for rank, _, _ in lines] == [str(r) for r in range(4)], result.stdout
    assert len({total for _, _, total in lines}) == 1, f"every rank prints the same output sum: {lines}"
    assert all(heads == "4" for _, heads, _ in lines), lines  # tp 2: half the heads on each rank
