"""Launch scripts under torchrun in a subprocess, for end-to-end tests (with a timeout)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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


def torchrun(script: str, nproc: int, args: list[str], timeout: float = 300, check: bool = True):
    """Run to completion; returns the CompletedProcess (stdout and stderr captured)."""
    result = subprocess.run(torchrun_command(script, nproc, args), cwd=ROOT, env=environment(),
                            capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{script} exited with {result.returncode}\n--- stderr ---\n{result.stderr[-6000:]}")
    return result


def metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}
