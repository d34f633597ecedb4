"""Check results, their agreement across ranks, and the printed report (see the package docstring)."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass

from ..tensor_parallel.collectives import all_gather_objects


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    detail: str


def run_guarded(name: str, check, *args) -> Result:
    """`check(*args) -> (ok, detail)` as a Result; an exception is a failure that names itself."""
    start = time.perf_counter()
    try:
        ok, detail = check(*args)
    except Exception as error:  # a crashing check is a failed check, reported like the others
        last = traceback.extract_tb(error.__traceback__)[-1]
        ok, detail = False, f"{type(error).__name__}: {error} ({last.filename.rsplit('/', 1)[-1]}:{last.lineno})"
    return Result(name, ok, f"{detail} [{time.perf_counter() - start:.1f} s]")


def agree(results: list[Result]) -> list[Result]:
    """Every rank's results gathered (one all_gather): a check fails if it failed on any rank, and
    then shows the first failing rank's detail."""
    per_rank = all_gather_objects([(r.name, r.ok, r.detail) for r in results])
    merged = []
    for i, result in enumerate(results):
        failed = [(rank, rows[i][2]) for rank, rows in enumerate(per_rank) if not rows[i][1]]
        if not failed:
            merged.append(Result(result.name, True, per_rank[0][i][2]))
            continue
        rank, detail = failed[0]
        others = f" (also failed on {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
        merged.append(Result(result.name, False, f"rank {rank}: {detail}{others}"))
    return merged


def report_lines(results: list[Result]) -> list[str]:
    """One line per check, then `check: PASS` or `check: FAIL name ...`."""
    lines = [f"[{'ok' if r.ok else 'FAIL'}] {r.name}: {r.detail}" for r in results]
    failed = [r.name for r in results if not r.ok]
    lines.append("check: FAIL " + " ".join(failed) if failed else "check: PASS")
    return lines
