"""SIGTERM and SIGINT become a flag read between steps (the trainer then checkpoints: tests/test_pretrain.py); a
second Ctrl-C stops the process at once, without a traceback."""

from __future__ import annotations

import signal
import subprocess
import sys

from parallel_attention.training.run.stop_signals import StopSignals

_TWICE = """
import os, signal, sys, time
from parallel_attention.training.run.stop_signals import StopSignals
stop = StopSignals()
os.kill(os.getpid(), signal.SIGINT)
print(stop.received, flush=True)  # the first Ctrl-C is only noted
os.kill(os.getpid(), signal.SIGINT)
time.sleep(30)
print("still running", flush=True)
"""


def test_the_first_signal_is_noted_and_the_handlers_restored():
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stop = StopSignals()
    try:
        assert not stop.raised and stop.name() == "a signal to another rank"  # another rank's: any_rank said so
        signal.raise_signal(signal.SIGTERM)
        assert stop.raised and stop.name() == "SIGTERM"
    finally:
        stop.restore()
    assert {sig: signal.getsignal(sig) for sig in previous} == previous


def test_a_second_ctrl_c_stops_at_once():
    result = subprocess.run([sys.executable, "-c", _TWICE], capture_output=True, text=True, timeout=20)
    assert result.returncode == -signal.SIGINT, (result.returncode, result.stderr)
    assert result.stdout == "SIGINT\n" and "Traceback" not in result.stderr
