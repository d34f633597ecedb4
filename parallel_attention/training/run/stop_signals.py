"""SIGTERM (preemption, a Slurm time limit) and SIGINT (Ctrl-C) as a flag that the trainer reads between steps, so
that the run agrees on the step, checkpoints and exits 0 instead of dying mid-step with its work lost.

Under torchrun the launcher's agent receives the signal (each worker runs in a session of its own) and sends it
on to every worker. A second SIGINT while the first is being handled stops the process at once, by the default
action (no checkpoint, no traceback): someone pressed Ctrl-C twice because they do not want to wait."""

from __future__ import annotations

import os
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Installs itself for SIGTERM and SIGINT on creation; `restore()` puts the previous handlers back."""

    def __init__(self) -> None:
        self.received: str | None = None  # the first signal's name (SIGTERM, SIGINT)
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    @property
    def raised(self) -> bool:
        return self.received is not None

    def name(self) -> str:
        """What stopped the run, as the final line says it: this rank's signal, or another rank's."""
        return self.received or "a signal to another rank"

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.raised:  # Ctrl-C again: stop now, as an unhandled SIGINT does
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
            return
        self.received = self.received or signal.Signals(signum).name

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
