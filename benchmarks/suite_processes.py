"""Count the Python interpreters a pytest run starts, by kind: what the suite pays in start-up.

    python benchmarks/suite_processes.py [PYTEST ARGS...]      e.g. python benchmarks/suite_processes.py -q

Runs `python -m pytest ARGS` with a `sitecustomize` on PYTHONPATH that appends each new interpreter's command line
to a log (a fork starts no interpreter and is not counted: that is the point of tests/launch_server.py), then
prints the count per kind and pytest's exit status. Each interpreter of a launch imports torch, and most of them
this package, `torch._dynamo` and matplotlib: about 3 CPU-seconds apiece on the 2-core development host.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SITECUSTOMIZE = '''
import os
if os.environ.get("PA_COUNT_INTERPRETERS"):
    with open("/proc/self/cmdline", "rb") as f:
        argv = [a.decode(errors="replace") for a in f.read().split(b"\\0") if a]
    with open(os.environ["PA_COUNT_INTERPRETERS"], "a", encoding="utf-8") as f:
        f.write(" ".join(argv)[:300].replace("\\n", " ") + "\\n")
'''


def kind(command: str) -> str:
    """What an interpreter was started for, from its command line."""
    for marker, name in (("exec(eval(sys.stdin", "pytest worker"), (" -m pytest", "pytest"), ("launch_server.py", "launch server"),
                         ("torch.distributed.run", "torchrun agent"), ("multiprocessing.spawn", "spawned process"),
                         ("multiprocessing.resource_tracker", "resource tracker"),
                         ("multiprocessing.forkserver", "forkserver"), ("scripts/", "script"), (" -c ", "python -c")):
        if marker in command:
            return name
    return "other: " + command[:80]


def main(pytest_args: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
        log = Path(tmp, "interpreters.log")
        path = os.pathsep.join(p for p in (tmp, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "PA_COUNT_INTERPRETERS": str(log)}
        status = subprocess.run([sys.executable, "-m", "pytest", *pytest_args], env=env).returncode
        lines = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
    counts = collections.Counter(kind(line) for line in lines)
    print(f"\n{len(lines)} interpreters started (pytest exit status {status}):")
    for name, count in counts.most_common():
        print(f"{count:6d}  {name}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
