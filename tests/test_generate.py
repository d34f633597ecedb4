"""Generation: the sliding window past max_seq_len (with the cache equal to recomputation over the same
cropped contexts), the stop at EOS, prompts of different lengths in one call, and scripts/generate.py
(--prompt-file, --print-tokens, one clean error line from rank 0 for bad arguments)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import ROOT, environment, run_command, torchrun
from parallel_attention import GPTModel, ModelConfig, PretrainConfig
from parallel_attention.checkpointing import write_canonical_checkpoint
from parallel_attention.training import DataConfig, ParallelConfig
from parallel_attention.transformer import generate
from parallel_attention.transformer.generation import generate_batch

WINDOW = 16
TINY = dict(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=WINDOW)


def _model(**fields) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(ModelConfig(**{**TINY, **fields})).eval()


def _reference_greedy(model: GPTModel, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Independent sliding window: every token predicted by a full forward over the last WINDOW tokens."""
    tokens = prompt
    for _ in range(n):
        logits = model(tokens[:, -WINDOW:])[-1]  # [b, V]: p = 1, the local logits are the full vocabulary
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    return tokens


# ------------------------------------------------------------------------------ library
@pytest.mark.parametrize("position_embedding", ["learned", "rotary"])
def test_sliding_window_cache_matches_recomputation(position_embedding):
    model = _model(position_embedding=position_embedding)
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    fed = []  # how many tokens each decode call runs: the prompt, single tokens, then whole rebuilt windows
    decode = model.decode
    model.decode = lambda tokens, cache: (fed.append(tokens.shape[1]), decode(tokens, cache))[1]
    cached = generate(model, prompt, 3 * WINDOW, temperature=0)
    assert cached.shape == (2, 5 + 3 * WINDOW)  # far past max_seq_len: every requested token is produced
    assert fed[:WINDOW - 4] == [5] + [1] * (WINDOW - 5) and set(fed[WINDOW - 4:]) == {WINDOW}
    assert torch.equal(generate(model, prompt, 3 * WINDOW, temperature=0, use_cache=False), cached)
    assert torch.equal(_reference_greedy(model, prompt, 3 * WINDOW), cached)


def test_long_prompt_is_cropped_to_the_window():
    model = _model()
    prompt = torch.randint(0, 256, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(2))
    out = generate(model, prompt, 4, temperature=0)
    assert torch.equal(out[:, :3 * WINDOW], prompt) and torch.equal(out, _reference_greedy(model, prompt, 4))


def test_generation_stops_at_eos_per_row():
    model = _model()
    prompt = torch.randint(0, 256, (3, 4), generator=torch.Generator().manual_seed(3))
    free = generate(model, prompt, 12, temperature=0)
    eos = free[0, 4 + 3].item()  # row 0's fourth new token
    out = generate(model, prompt, 12, temperature=0, eos_token_id=eos)
    firsts = [row[4:].tolist().index(eos) if eos in row[4:].tolist() else None for row in free]
    assert out.shape[1] == 4 + (12 if None in firsts else max(firsts) + 1)  # the loop ends when all rows finished
    for row, first in enumerate(firsts):
        stop = 4 + (12 if first is None else first + 1)
        assert torch.equal(out[row, :stop], free[row, :stop])
        assert (out[row, stop:] == eos).all()  # a finished row keeps emitting EOS as padding
    assert generate_batch(model, [prompt[0].tolist()], 12, temperature=0, eos_token_id=eos) == \
        [free[0, :4 + firsts[0] + 1].tolist()]


def test_prompts_of_different_lengths_match_one_by_one():
    model = _model(position_embedding="rotary")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 7, 3, 20)]
    batched = generate_batch(model, prompts, 10, temperature=0)
    alone = [generate(model, torch.tensor([p]), 10, temperature=0)[0].tolist() for p in prompts]
    assert batched == alone


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=-1), "max_new_tokens=-1"), (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(top_k=0), "top_k=0"), (dict(prompt=torch.zeros(2, 0, dtype=torch.long)), r"shape \(2, 0\)"),
])
def test_bad_arguments_are_named(kwargs, match):
    args = dict(prompt=torch.zeros(1, 2, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match=match):
        generate(_model(), **{**args, **kwargs})


# ------------------------------------------------------------------------------ script
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with a step-0 checkpoint of a tiny byte-level model (max_seq_len 16)."""
    run = tmp_path_factory.mktemp("gen") / "run"
    cfg = PretrainConfig(model=ModelConfig(**TINY), parallel=ParallelConfig(tensor_parallel_size=2),
                         data=DataConfig(seq_len=WINDOW))
    write_canonical_checkpoint(run / "checkpoints", cfg.to_dict(), _model().canonical_state_dict(), step=0)
    return run


def _token_lines(stdout: str) -> list[list[int]]:
    return [list(map(int, line.split()[1:])) for line in stdout.splitlines() if line.startswith("tokens:")]


@pytest.mark.slow  # CI keeps the in-process sliding-window tests and the script's EOS and error tests
def test_script_prompt_file_and_window(run_dir, tmp_path):
    (tmp_path / "prompts.txt").write_text("def main(\n\nclass A:\n")
    args = ["--checkpoint", str(run_dir), "--prompt", "import os", "--prompt-file", str(tmp_path / "prompts.txt"),
            "--max-new-tokens", str(2 * WINDOW), "--temperature", "0", "--print-tokens"]
    outputs = [torchrun("generate.py", 2, args + flag, timeout=240).stdout for flag in ([], ["--no-cache"])]
    lines = _token_lines(outputs[0])
    assert lines == _token_lines(outputs[1]) and len(lines) == 3
    model = _model()
    for line, prompt in zip(lines, ["import os", "def main(", "class A:"]):  # prompt order, blank line skipped
        expected = generate_batch(model, [list(prompt.encode())], 2 * WINDOW, temperature=0, eos_token_id=0)[0]
        assert line == expected  # p = 2 under torchrun equals p = 1 here; 2 x max_seq_len new tokens (or EOS)


def test_script_stops_at_eos(run_dir, tmp_path):
    """Zero final-norm weights make every logit 0: greedy picks id 0, the byte tokenizer's end of text."""
    model = _model()
    with torch.no_grad():
        model.final_norm.weight.zero_()
        model.final_norm.bias.zero_()
    cfg = PretrainConfig(model=ModelConfig(**TINY), data=DataConfig(seq_len=WINDOW))
    write_canonical_checkpoint(tmp_path / "run" / "checkpoints", cfg.to_dict(), model.canonical_state_dict())
    out = torchrun("generate.py", 2, ["--checkpoint", str(tmp_path / "run"), "--prompt", "ab", "--prompt", "xyz",
                                      "--max-new-tokens", "20", "--temperature", "0", "--print-tokens"], timeout=240)
    assert _token_lines(out.stdout) == [[97, 98, 0], [120, 121, 122, 0]]
    assert out.stdout.splitlines()[1] == "ab"  # decoded without the end-of-text token


def _direct(args: list[str], rank: int) -> subprocess.CompletedProcess:
    """generate.py as rank `rank` of 2 would start it: bad input is refused before any process group."""
    env = {**environment(), "RANK": str(rank), "WORLD_SIZE": "2"}
    return run_command([sys.executable, str(ROOT / "scripts" / "generate.py"), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,message", [
    (["--max-new-tokens", "-3"], "--max-new-tokens=-3 must be >= 0"),
    (["--top-k", "x"], "invalid int value: 'x'"),
    (["--prompt-file", "/nonexistent/prompts.txt"], "--prompt-file=/nonexistent/prompts.txt is not a file"),
    (["--prompt", ""], "encodes to no tokens"),
])
def test_bad_arguments_give_one_line_from_rank_0(run_dir, args, message):
    for rank in (0, 1):
        result = _direct(["--checkpoint", str(run_dir), *args], rank)
        assert result.returncode == 2 and result.stdout == ""
        if rank == 0:
            assert result.stderr.splitlines() == [f"error: {result.stderr.split('error: ', 1)[1].strip()}"]
            assert message in result.stderr and "Traceback" not in result.stderr
        else:
            assert result.stderr == ""


def test_a_checkpoint_that_does_not_exist_is_named_with_the_nearest_run(run_dir):
    typo = run_dir.parent / "rnu"  # beside run_dir, one transposition away
    result = _direct(["--checkpoint", str(typo)], 0)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(f"error: --checkpoint={typo}: no such directory. Did you mean {run_dir}? "
                                    "Pretraining writes it: scripts/pretrain.py saves checkpoints under its "
                                    "logging.run_dir")
    relative = _direct(["--checkpoint", "runs/surely_not_here"], 0).stderr  # run from ROOT
    assert f"--checkpoint=runs/surely_not_here: no such directory (relative to {ROOT})." in relative


def test_the_script_builds_its_model_on_an_explicit_tp_group():
    import ast

    tree = ast.parse((ROOT / "scripts" / "generate.py").read_text(encoding="utf-8"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "GPTModel"]
    assert calls and all("tp_group" in {k.arg for k in call.keywords} for call in calls)


_SLOW_RANK_0 = """import os, runpy, sys, time
if os.environ["RANK"] == "0":
    time.sleep(3)  # rank 0 still busy when rank 1 has found the error: torchrun must not stop it unheard
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("slow_rank_0", [False, True])
def test_bad_checkpoint_under_torchrun(tmp_path, slow_rank_0):
    script = "generate.py"
    if slow_rank_0:
        script = str(tmp_path / "slow_rank_0.py")
        Path(script).write_text(_SLOW_RANK_0.format(script=str(ROOT / "scripts" / "generate.py")))
    # real: what torchrun itself reports of every worker (tests/launch.py, run_command)
    result = torchrun(script, 2, ["--checkpoint", str(tmp_path / "nothing")], timeout=240, check=False, real=True)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "no such directory" in errors[0]
    assert result.stderr.startswith(errors[0])  # first, before torchrun's own report
    # no traceback from a rank; torchrun's report names rank 0, with our line, as the root cause, and every
    # worker exits with 2 (none is stopped by a signal half-way)
    assert 'generate.py", line' not in result.stderr
    root_cause = result.stderr.split("Root Cause (first observed failure):")[1]
    assert "rank      : 0 (local_rank: 0)" in root_cause and f"traceback : {errors[0]}" in root_cause
    exit_codes = [line.split(":")[1].split()[0] for line in result.stderr.splitlines() if "exitcode  :" in line]
    assert exit_codes == ["2", "2"]
