"""`python -m parallel_attention.check --cp 2` under torchrun at world 2: every check passes, the context-parallel
one among them (both kinds against the float64 reference, with and without documents, collectives counted).
The command is the README's, as written (tests/test_check.py's DOCUMENTED)."""

from __future__ import annotations

from test_check import run_check, verdicts


def test_the_self_check_checks_context_parallel_attention():
    code, lines = run_check("--cp", "2")
    found = verdicts(lines)
    assert code == 0 and found.pop("context-parallel") and all(found.values()), lines
    line = next(line for line in lines if "context-parallel" in line)
    assert "ring all_to_all, +-documents, collectives counted" in line, line
