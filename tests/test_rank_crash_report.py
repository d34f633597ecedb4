"""The test harness itself: a rank that a signal kills (a segfault in a kernel or a backend) fails its test with
the rank's Python stack at the signal, from pooled ranks and from fresh ones alike; without it, CI printed only
"exited with code -11" (tests/distributed.py, enable_crash_log)."""

from __future__ import annotations

import pytest

from distributed import run_distributed


def _segfault_on_rank_1() -> int:
    import ctypes

    import torch.distributed as dist

    if dist.get_rank() == 1:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return dist.get_rank()


@pytest.mark.parametrize("fresh", [False, True], ids=["pooled", "fresh"])
def test_a_segfaulting_rank_reports_its_stack(fresh):
    with pytest.raises(RuntimeError) as failure:
        run_distributed(_segfault_on_rank_1, 2, fresh=fresh, timeout=60)
    message = str(failure.value)
    assert "rank 1 exited with code -11 without reporting" in message
    assert "rank 1's stacks at the signal" in message and "Segmentation fault" in message
    assert "in _segfault_on_rank_1" in message  # the Python frame that crashed
