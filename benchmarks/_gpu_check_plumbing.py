"""gpu_check.sh --dry-run's check of its steps: each command would start, without running it (no GPU needed).

    python benchmarks/_gpu_check_plumbing.py COMMAND...     (exit 1, naming the problem, if it would not start)
    python benchmarks/_gpu_check_plumbing.py --logs LOGS    (every step gpu_check.sh recorded in LOGS/steps.order,
                                                             its command in LOGS/NAME.cmd: LOGS/NAME.log and steps.tsv,
                                                             dry_run where it would start)

The program resolves on PATH; every `-m MODULE` is importable; every .py file named exists and its imports load
(executed as a module not named __main__, so its main() does not run; its own directory on sys.path, as when it
runs as a script).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

try:  # a test module that skips itself at import (pytest.importorskip) starts fine: pytest reports it skipped
    from pytest import skip
    SKIPS_ITSELF = skip.Exception
except ImportError:  # a bare interpreter: nothing raises it
    SKIPS_ITSELF = ()


def _load(path: Path) -> None:
    sys.path.insert(0, str(path.parent.resolve()))
    spec = importlib.util.spec_from_file_location(f"_plumbing_{path.stem}", path)
    sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)


def problems(command: list[str]) -> list[str]:
    found = [] if shutil.which(command[0]) else [f"program {command[0]!r} is not on PATH"]
    for flag, value in zip(command, command[1:]):
        if flag == "-m" and importlib.util.find_spec(value) is None:
            found.append(f"module {value!r} is not importable")
    for arg in (a for a in command[1:] if a.endswith(".py")):
        path = Path(arg)
        if not path.is_file():
            found.append(f"no file {arg}")
            continue
        try:
            _load(path)
        except SKIPS_ITSELF:
            pass
        except Exception as error:  # what the step would die of at its first line
            found.append(f"{arg}: its imports fail: {type(error).__name__}: {error}")
    return found


def _report(command: list[str]) -> tuple[bool, str]:
    errors = problems(command)
    return not errors, "\n".join(errors) if errors else f"would start: {' '.join(command[:3])} ..."


def check_steps(logs: Path) -> int:
    """Each recorded step's verdict into its log and steps.tsv (as gpu_check.sh records a run); the exit status."""
    failed = 0
    with open(logs / "steps.tsv", "a", encoding="utf-8") as table:
        for name in (logs / "steps.order").read_text(encoding="utf-8").split():
            ok, text = _report((logs / f"{name}.cmd").read_text(encoding="utf-8").splitlines())
            (logs / f"{name}.log").write_text(text + "\n", encoding="utf-8")
            table.write(f"{name}\t{'dry_run' if ok else 'failed(plumbing)'}\t0\n")
            print(f"== {name}: {'would start' if ok else text}", file=sys.stderr)
            failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--logs"]:
        sys.exit(check_steps(Path(sys.argv[2])))
    passed, message = _report(sys.argv[1:])
    print(message)
    sys.exit(0 if passed else 1)
