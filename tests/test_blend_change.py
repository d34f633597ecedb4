"""A blend changed at a resume, end to end (issue 39 item 3): a run trains on two sources, is resumed with other
weights and a third source under checkpoint.allow_data_change, says the change, keeps each source's epochs counting
on (no jump), and inspect_data.py, given the run's new config, still names exactly what every step read: the steps
before the change as it said before, the steps after from the new blend, with no window read twice."""

from __future__ import annotations

import json
import sys

from blend_runs import blend_args
from launch import ROOT, environment, metrics, run_command, torchrun
from parallel_attention.training import load_config
from parallel_attention.training.data.read.token_source import open_source
from random_prefixes import random_prefix


def _args(blend, run_dir, steps, *extra):
    return blend_args(blend, run_dir, steps, *extra, micro_batch_size=4, eval_interval=100)


def _inspect(args: list[str], steps: str) -> list[dict]:
    run = run_command([sys.executable, str(ROOT / "scripts" / "inspect_data.py"), *args, "--steps", steps,
                       "--json"], capture_output=True, text=True, timeout=300, env=environment())
    assert run.returncode == 0, run.stderr
    return [json.loads(line) for line in run.stdout.splitlines()]


def test_a_blend_changed_at_a_resume_continues_each_sources_epochs(tmp_path):
    web, code, math = (random_prefix(tmp_path / name, n, seed, vocab=256)
                       for name, n, seed in (("web", 300, 1), ("code", 200, 2), ("math", 150, 3)))
    run_dir = tmp_path / "run"
    first = [(web, 0.7), (code, 0.3)]
    torchrun("pretrain.py", 1, _args(first, run_dir, 6))
    before = _inspect(_args(first, run_dir, 6), "0:6")
    changed = [(web, 0.3), (code, 0.3), (math, 0.4)]
    resumed = torchrun("pretrain.py", 1, _args(changed, run_dir, 10, "--checkpoint.allow_data_change=true"))
    assert (f"the blend changes at step 6: {web} weight 0.7 -> 0.3 (continues at " in resumed.stderr and
            f"{math} added with weight 0.4" in resumed.stderr), resumed.stderr[-3000:]
    assert f"; by step 10: {web} weight 0.3, " in resumed.stderr

    after = _inspect(_args(changed, run_dir, 10, "--checkpoint.allow_data_change=true"), "0:10")
    assert [r for r in after if r["step"] < 6] == before  # the past, as it was read
    assert {r["source"] for r in after if r["step"] >= 6} == {web, code, math}
    assert {r["source"] for r in before} == {web, code}
    for source in (web, code, math):  # far from an epoch's end: every window read once
        offsets = [r["offset"] for r in after if r["source"] == source]
        assert len(offsets) == len(set(offsets)) and offsets, source

    epochs = {r["step"]: r["epochs"] for r in metrics(run_dir) if "loss" in r}
    assert sorted(epochs) == list(range(1, 11))
    val_fraction = load_config(ROOT / "configs" / "gpt_tiny.yaml").data.val_fraction
    for source in (web, code, math):  # each source's epochs: every window it read, before the change too
        windows = (open_source(source, val_fraction, (256, "byte")).train.num_tokens - 1) // 32
        for step, counts in epochs.items():
            if source in counts:
                read = sum(r["source"] == source for r in after if r["step"] < step)
                assert counts[source] == round(read / windows, 4), (source, step)
    assert epochs[6].keys() == {web, code} and epochs[7].keys() == {web, code, math}
    manifest = json.loads((run_dir / "checkpoints" / "step_0000009" / "manifest.json").read_text())
    history = manifest["extra"]["data_identity"]["blend_history"]
    assert [phase["step"] for phase in history] == [0, 6]
