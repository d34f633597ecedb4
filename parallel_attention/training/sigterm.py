"""SIGTERM (preemption, a Slurm time limit) as a flag the trainer reads between steps."""

from __future__ import annotations

import signal


class SigtermFlag:
    """Turns SIGTERM into a flag checked between steps, so the run can checkpoint and exit cleanly."""

    def __init__(self) -> None:
        self.raised = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.raised = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
