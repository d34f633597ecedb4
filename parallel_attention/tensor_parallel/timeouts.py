"""Timeouts of collectives, named: which operation, on which group, within what limit.

A backend reports a timeout as a bare RuntimeError; `named_timeouts` turns it into CollectiveTimeoutError with
the operation, the group and the configured limit, so the rank's log says what stopped answering.
"""

from __future__ import annotations

import contextlib
import re

from .parallel_state import ProcessGroup, collective_timeout, describe_group


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the groups' timeout: some rank stopped answering."""


@contextlib.contextmanager
def named_timeouts(op: str, group: ProcessGroup | None):
    """Re-raise a backend's timeout as CollectiveTimeoutError naming the operation and the group."""
    try:
        yield
    except RuntimeError as error:  # gloo and NCCL (DistBackendError) report timeouts as RuntimeErrors
        if isinstance(error, CollectiveTimeoutError) or not _TIMEOUT_WORDS.search(str(error)):
            raise  # not a timeout, or one an inner collective already named
        raise CollectiveTimeoutError(
            f"{op} on the {describe_group(group)} did not complete within the timeout "
            f"({collective_timeout() or 'torch default'}): a rank stopped answering (hung, stopped or dead). "
            f"Backend said: {str(error).splitlines()[0]}") from error


# TORCH_DISTRIBUTED_DEBUG=DETAIL puts a monitored barrier before each collective: a rank missing there times out too
_TIMEOUT_WORDS = re.compile(r"timed out|timeout|failed to pass monitoredBarrier", re.IGNORECASE)
