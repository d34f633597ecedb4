"""report_from_rank_0 without torchrun's agent store: a rank started by hand leaves the report to rank 0; under
torchrun with no store to wait on (another rendezvous backend), every rank says its own error rather than none.
With the store, tests/test_generate.py runs it under torchrun with rank 0 held back."""

from __future__ import annotations

import pytest

from parallel_attention.tensor_parallel.report_once import report_from_rank_0

TORCHRUN = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_launcher(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("rank, said", [("0", "error: bad\n"), ("1", "")])
def test_by_hand_only_rank_0_speaks(no_launcher, capsys, rank, said):
    no_launcher.setenv("RANK", rank)
    report_from_rank_0("error: bad")
    assert capsys.readouterr().err == said


def test_under_torchrun_without_its_store_a_rank_speaks_for_itself(no_launcher, capsys):
    no_launcher.setenv("RANK", "1")
    no_launcher.setenv("TORCHELASTIC_RUN_ID", "test")  # torchrun, but its agent serves no store
    report_from_rank_0("error: bad")
    assert capsys.readouterr().err == "rank 1: error: bad\n"
