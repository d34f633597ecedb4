"""An unwritable run directory is refused at start, on every rank, with exit 2 and a named message, instead of
being found at the first checkpoint after the time spent training up to it."""

from __future__ import annotations

import os
import stat
import subprocess

from launch import ROOT, environment, torchrun_command
from test_pretrain import data_dir, tiny_args  # noqa: F401  (data_dir is a fixture)


def test_an_unwritable_run_dir_is_refused_before_training(data_dir, tmp_path):  # noqa: F811
    if os.geteuid() == 0:  # root ignores permission bits: a path under a regular file cannot be made by anyone
        (tmp_path / "file.txt").write_text("not a directory")
        run_dir = tmp_path / "file.txt" / "run"
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)  # 0o555
        run_dir = locked / "run"
    command = torchrun_command("pretrain.py", 2, tiny_args(data_dir, run_dir, 2, 3))
    result = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=180)
    assert result.returncode != 0, result.stderr[-3000:]
    assert "config error: logging.run_dir=" in result.stderr and "is not writable" in result.stderr, \
        result.stderr[-3000:]
    # every rank refuses with exit status 2 (pretrain.py's for a config error), but torchrun stops the other rank
    # as soon as one exits, so the second report may be cut short
    assert "exitcode  : 2" in result.stderr, result.stderr[-3000:]
    # no rank aborts on the way out: the process group is torn down before the exit (a live gloo group at the
    # interpreter's exit could end in "terminate called without an active exception", SIGABRT)
    assert "terminate called" not in result.stderr and "SIGABRT" not in result.stderr, result.stderr[-3000:]
    assert not (run_dir.parent / "metrics.jsonl").exists() and "pretrain.py\", line" not in result.stderr
