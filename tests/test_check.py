"""`python -m parallel_attention.check` under torchrun at world 2: the output contract, exit status 0 at
--tp 2 and --tp 1, and each injected fault (a perturbed replica, a mis-sharded weight) seen as FAIL.

The docs' commands of the check (DOCUMENTED) run here as written, with the contract asserted on their output;
tests/test_readme.py leaves them to this file rather than launching them twice."""

from __future__ import annotations

import re
import shlex
import sys

import pytest

from launch import ROOT, environment, run_command

CHECKS = ("collectives", "attention", "model", "init", "replicas", "collective-count")
LINE = re.compile(r"^\[(ok|FAIL)\] ([a-z-]+): .+$")
CHECK = "torchrun --standalone --nproc-per-node 2 -m parallel_attention.check"
DOCUMENTED = (CHECK, f"{CHECK} --tp 1", f"{CHECK} --cp 2")  # as README.md and docs/ show them


def run_check(*args: str) -> tuple[int, list[str]]:
    """The check at world 2 with `args`: (exit status, stdout lines). `torchrun` is this interpreter's."""
    argv = shlex.split(" ".join([CHECK, *args]))
    command = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    # two ranks on two shared cores take ~20 s; a hang fails here instead of blocking CI
    result = run_command(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=240)
    lines = result.stdout.splitlines()
    assert lines, f"no output\n--- stderr ---\n{result.stderr[-4000:]}"
    return result.returncode, lines


def verdicts(lines: list[str]) -> dict[str, bool]:
    """The contract: `# ` lines, then one `[ok]`/`[FAIL] NAME: detail` line per check, then the verdict."""
    body = [line for line in lines[:-1] if not line.startswith("# ")]
    assert body and all(LINE.match(line) for line in body), lines
    found = {LINE.match(line)[2]: LINE.match(line)[1] == "ok" for line in body}
    assert len(found) == len(body) and set(CHECKS) <= set(found), lines
    return found


@pytest.mark.parametrize("args, tp", [((), "2"), (("--tp", "1"), "1")], ids=["documented", "documented-tp1"])
def test_passes_at_world_two(args, tp):
    code, lines = run_check(*args)
    assert all(verdicts(lines).values()), lines
    assert lines[-1] == "check: PASS" and code == 0, lines
    assert any(line.startswith("# path: attention") for line in lines)  # the active kernel path is shown
    assert f"tp {tp}, dp {2 // int(tp)}" in lines[0]


@pytest.mark.parametrize("fault,failed", [("replica", "replicas"), ("layout", "attention")])
def test_an_injected_fault_fails(fault, failed):
    code, lines = run_check("--inject-fault", fault)
    found = verdicts(lines)
    assert not found[failed], lines
    assert [name for name, ok in found.items() if not ok] == [failed], lines  # nothing else is blamed
    assert lines[-1] == f"check: FAIL {failed}" and code == 1, lines


def test_a_tensor_parallel_size_that_does_not_fit_fails_in_the_same_format():
    code, lines = run_check("--tp", "3")
    assert lines[-1] == "check: FAIL setup" and lines[-2].startswith("[FAIL] setup: world size 2") and code == 1
