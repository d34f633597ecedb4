"""Launch the project's command lines for end-to-end tests (with a timeout).

`run_command(command, ...)` is subprocess.run for the tests' Python command lines (`python script.py`, `python -m module`,
`python -m torch.distributed.run ...`), forked from a server that has imported torch and the package once per
pytest worker (tests/launch_server.py), so that a launch no longer pays every process's imports. Commands it cannot
fork faithfully (another interpreter, another PYTHONPATH, input on stdin, output not captured) run as real
subprocesses, and so does every command while `PA_TEST_REAL_LAUNCH=1` is set. Tests of torchrun itself (signals to
the agent, a killed launcher, two agents, Slurm) start real processes with subprocess.Popen.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(script: str, nproc: int, args: list[str], agent_args: list[str] | None = None) -> list[str]:
    agent = agent_args if agent_args is not None else ["--standalone"]
    return [sys.executable, "-m", "torch.distributed.run", *agent, "--nproc-per-node", str(nproc),
            str(ROOT / "scripts" / script), *args]


def environment() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(script: str, nproc: int, args: list[str], timeout: float = 300, check: bool = True, real: bool = False):
    """Run to completion; returns the CompletedProcess (stdout and stderr captured). `real`: see run_command."""
    result = run_command(torchrun_command(script, nproc, args), cwd=ROOT, env=environment(), timeout=timeout,
                         real=real)
    if check and result.returncode != 0:
        raise AssertionError(f"{script} exited with {result.returncode}\n--- stderr ---\n{result.stderr[-6000:]}")
    return result


def metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


def run_command(command: list[str], *, cwd=None, env: dict | None = None, timeout: float = 300, check: bool = False,
                capture_output: bool = True, text: bool = True, real: bool = False) -> subprocess.CompletedProcess:
    """subprocess.run(command, cwd=, env=, capture_output=, text=, timeout=, check=), forked where it can be.

    real=True always starts real processes: for tests of what torchrun itself reports. Its workers there are
    interpreters it polls one by one, so its failure report lists every worker that failed with its exit status;
    the forked workers of launch_server are one torch.multiprocessing context, whose first failure stops the others.
    """
    env = dict(os.environ if env is None else env)
    forkable = (not real and command[0] == sys.executable and capture_output and text
                and env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")
                and os.environ.get("PA_TEST_REAL_LAUNCH") != "1")
    if not forkable:
        return subprocess.run(command, cwd=cwd, env=env, capture_output=capture_output, text=text, timeout=timeout,
                              check=check)
    result = _server().run(command, str(cwd or os.getcwd()), env, timeout)
    if check and result.returncode:
        raise subprocess.CalledProcessError(result.returncode, command, result.stdout, result.stderr)
    return result


class LaunchServer:
    """The client of this pytest process's tests/launch_server.py (started on first use, killed at exit)."""

    def __init__(self) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="pa-launch-")
        address = os.path.join(self.tmp.name, "socket")
        log = open(os.path.join(self.tmp.name, "server.log"), "w")
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("launch_server.py")), address],
                                        env=environment(), stdout=log, stderr=subprocess.STDOUT)
        self.connection = self._connect(address)
        self.lock = threading.Lock()
        atexit.register(self.close)

    def _connect(self, address: str, within: float = 120):
        deadline = time.monotonic() + within
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the launch server exited with {self.process.returncode}: "
                                   + Path(self.tmp.name, "server.log").read_text())
            try:
                connection = Client(address, family="AF_UNIX")
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the launch server did not listen within {within:.0f} s") from None
                time.sleep(0.1)
        assert connection.recv() == "ready"
        return connection

    def run(self, command: list[str], cwd: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
        with self.lock, tempfile.TemporaryDirectory(dir=self.tmp.name) as out:
            paths = {"stdout": os.path.join(out, "stdout"), "stderr": os.path.join(out, "stderr")}
            self.connection.send({"argv": command[1:], "cwd": cwd, "env": env, "timeout": timeout, **paths})
            answer = self.connection.recv()
            stdout, stderr = (Path(paths[k]).read_text(encoding="utf-8", errors="replace") for k in paths)
        if answer["timed_out"]:
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        result = subprocess.CompletedProcess(command, answer["returncode"], stdout, stderr)
        result.cpu_s = answer["cpu_s"]  # the command's CPU seconds, for benchmarks of the launcher
        return result

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.tmp.cleanup()


_SERVER: list[LaunchServer] = []


def _server() -> LaunchServer:
    if not _SERVER or _SERVER[0].process.poll() is not None:
        _SERVER[:] = [LaunchServer()]
    return _SERVER[0]
