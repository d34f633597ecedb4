"""report_from_rank_0 without torchrun's agent store: a rank started by hand leaves the report to rank 0; under
torchrun with no store to wait on (another rendezvous backend), every rank says its own error rather than none.
What a rank says also goes to torchrun's error file, in the layout torchrun's report reads. Under torchrun with
its store: a misspelt config key is said once, first, and torchrun's report names rank 0 with it as the root
cause (tests/test_generate.py does the same for generate.py, with rank 0 held back)."""

from __future__ import annotations

import json

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from launch import ROOT, torchrun
from parallel_attention.launch.rank_zero import is_rank_zero
from parallel_attention.launch.report_once import record_errors, report_from_rank_0

TORCHRUN = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_ERROR_FILE")


@pytest.fixture
def no_launcher(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("rank, zero", [("0", True), ("1", False), (None, True)])
def test_without_a_process_group_rank_zero_is_torchruns_rank_0(monkeypatch, rank, zero):
    """is_rank_zero, the one test of rank 0, asks torchrun's RANK where no process group exists (before it, after
    it, or a process outside torchrun: rank 0)."""
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    assert is_rank_zero() is zero


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


@pytest.mark.parametrize("rank, written", [("0", "error: bad"), ("1", "rank 1: error: bad")])
def test_what_a_rank_says_is_what_torchruns_report_shows(no_launcher, tmp_path, rank, written):
    error_file = tmp_path / "error.json"
    no_launcher.setenv("RANK", rank)
    no_launcher.setenv("TORCHELASTIC_RUN_ID", "test")
    no_launcher.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    report_from_rank_0("error: bad")
    assert json.loads(error_file.read_text())["message"]["message"] == written
    failure = ProcessFailure(local_rank=int(rank), pid=1, exitcode=2, error_file=str(error_file))  # torch's reader
    assert f"traceback : {written}\n" in ChildFailedError("pretrain.py", {int(rank): failure}).format_msg()


def _refuses(value: int) -> int:
    raise ValueError(f"value={value} is bad: pass 1")


def test_an_error_no_entry_point_caught_is_torchruns_root_cause_in_one_line(no_launcher, tmp_path):
    """It goes on (the rank's traceback is printed as before); torchrun's report shows its one line where it said
    only "To enable traceback see ..."."""
    error_file = tmp_path / "error.json"
    no_launcher.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(ValueError, match="value=2 is bad"):
        record_errors(_refuses)(2)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))  # torch's reader
    report = ChildFailedError("pretrain.py", {0: failure}).format_msg()
    line = next(line for line in report.splitlines() if "traceback :" in line)
    assert line.startswith("  traceback : ValueError: value=2 is bad: pass 1 (raised at test_report_once.py:") \
        and line.endswith(" in _refuses; the traceback is in this rank's output)"), report
    assert record_errors(lambda: 0)() == 0 and json.loads(error_file.read_text())  # a clean exit writes nothing new


def test_a_misspelt_key_under_torchrun_is_said_once_first_and_is_the_root_cause(tmp_path):
    result = torchrun("pretrain.py", 2, ["--config", str(ROOT / "configs" / "quickstart.yaml"),
                                         "--model.num_layer=2", f"--logging.run_dir={tmp_path / 'run'}"],
                      timeout=240, check=False, real=True)  # what torchrun itself reports of every worker
    said = [line for line in result.stderr.splitlines() if line.startswith("config error: ")]
    assert len(said) == 1 and said[0].startswith(
        "config error: unknown config key(s): model.num_layer (did you mean model.num_layers?); known keys here: ")
    assert result.stderr.startswith(said[0] + "\n")  # first, before anything torchrun prints
    assert result.returncode == 1  # torchrun's own status for any failed worker; each worker exited with 2
    root_cause = result.stderr.split("Root Cause (first observed failure):")[1]
    assert "rank      : 0 (local_rank: 0)" in root_cause and f"traceback : {said[0]}\n" in root_cause
    others = result.stderr.split("Failures:")[1].split("Root Cause")[0]
    assert "traceback : rank 1: the same error as rank 0" in others
    exit_codes = [line.split(":")[1].split()[0] for line in result.stderr.splitlines() if "exitcode  :" in line]
    assert exit_codes == ["2", "2"]  # no worker stopped half-way by a signal
    assert not (tmp_path / "run").exists()
