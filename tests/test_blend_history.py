"""A blend that changes mid-run (issue 39 item 3): each source continues its own epochs across the change (no window
read twice before its epoch ends), a removed source is no longer drawn, an added one starts at its first window, an
unchanged blend keeps today's batches bit for bit, and every past step's rows come back from the history."""

from __future__ import annotations

import numpy as np
import pytest

from parallel_attention.training.data.read.batches import GlobalBatchSampler
from parallel_attention.training.data.read.blend_history import (continue_blend, describe_change, extend_history,
                                                            first_history, windows_read)
from parallel_attention.training.data.read.token_source import open_source
from random_prefixes import random_prefix

SEQ, BATCH, SEED = 16, 8, 11


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("history")
    return {name: open_source(random_prefix(root / name, n, seed), 0.1, (300, "byte"))
            for name, n, seed in (("web", 60, 1), ("code", 25, 2), ("math", 20, 3))}


def _identity(blend, sources) -> dict:
    return {"sources": [{"path": sources[name].name, "sha256": name, "weight": w} for name, w in blend]}


def _sampler(blend, sources, history=None, open_phase=None) -> GlobalBatchSampler:
    sampler = GlobalBatchSampler([sources[n] for n, _ in blend], [w for _, w in blend], SEQ, BATCH, SEED)
    if history is not None:
        continue_blend(sampler, history, open_phase)
    return sampler


def _run(phases, sources, steps: int):
    """A run whose blend is phases[i][1] from step phases[i][0] on, resumed at each change: the history, the last
    sampler (which answers every past step), and per source the (epoch, offset) of every window it read."""
    history, samplers = first_history(_identity(phases[0][1], sources), BATCH), {}
    for start, blend in phases[1:]:
        history = extend_history(history, _identity(blend, sources), start, BATCH)
    by_start = {start: blend for start, blend in phases}

    def open_phase(phase):
        return _sampler(by_start[phase["step"]], sources)

    last = _sampler(phases[-1][1], sources, history, open_phase)
    read: dict[str, list] = {}
    for step in range(steps):
        phase = last.phase_at(step)
        rows = phase.rows(step)
        for j, epoch, offset in zip(rows.source, rows.epoch, rows.offset):
            read.setdefault(phase.sources[j].name, []).append((int(epoch), int(offset)))
        samplers[step] = phase
    return history, last, read, samplers


def _each_epoch_reads_every_window_once(windows: list, num_windows: int) -> None:
    epochs = [e for e, _ in windows]
    assert epochs == sorted(epochs) and epochs == [i // num_windows for i in range(len(windows))]
    for epoch in set(epochs):
        offsets = [o for e, o in windows if e == epoch]
        assert len(set(offsets)) == len(offsets)  # no window twice within an epoch


def test_an_unchanged_blend_keeps_todays_batches(sources):
    blend = [("web", 0.7), ("code", 0.3)]
    today = _sampler(blend, sources)
    continued = _sampler(blend, sources, extend_history(first_history(_identity(blend, sources), BATCH),
                                                        _identity(blend, sources), 40, BATCH))
    for step in (0, 1, 17, 39, 40, 41, 200):
        a, b = today.rows(step), continued.rows(step)
        assert all(np.array_equal(x, y) for x, y in ((a.source, b.source), (a.draw, b.draw), (a.epoch, b.epoch),
                                                     (a.offset, b.offset)))
        assert today.epochs(step) == continued.epochs(step)


def test_another_batch_size_alone_starts_no_blend(sources):
    blend = _identity([("web", 0.7), ("code", 0.3)], sources)
    history = extend_history(first_history(blend, BATCH), blend, 40, 2 * BATCH)
    assert len(history) == 1 and history[0]["global_batch_size"] == 2 * BATCH and history[0]["step"] == 0


@pytest.mark.parametrize("phases", [
    [(0, [("web", 0.7), ("code", 0.3)]), (23, [("web", 0.2), ("code", 0.8)])],  # weights
    [(0, [("web", 0.7), ("code", 0.3)]), (17, [("web", 0.5), ("code", 0.3), ("math", 0.2)])],  # a source added
    [(0, [("web", 0.5), ("code", 0.3), ("math", 0.2)]), (19, [("code", 0.6), ("web", 0.4)])],  # removed, reordered
    [(0, [("web", 0.6), ("math", 0.4)]), (9, [("web", 1.0)]), (30, [("math", 0.5), ("web", 0.5)])],  # back again
])
def test_each_source_continues_its_own_epochs_across_changes(sources, phases):
    steps = 70
    history, last, read, samplers = _run(phases, sources, steps)
    for name, windows in read.items():
        source = next(s for s in sources.values() if s.name == name)
        _each_epoch_reads_every_window_once(windows, (source.train.num_tokens - 1) // SEQ)
    for (start, blend), following in zip(phases, [*phases[1:], (steps, None)]):
        names = {sources[n].name for n, _ in blend}
        assert all({s.name for s in samplers[step].sources} == names for step in range(start, following[0]))
    drawn = {s.name: n for s, n in zip(last.sources, last.first_draws)}
    read_at = windows_read(history, phases[-1][0])  # by key: what the last phase continues from
    assert sorted(drawn.values()) == sorted(read_at.get(s["key"], 0) for s in history[-1]["sources"])
    epochs = last.epochs(steps)
    for name, windows in read.items():
        if name in epochs:  # each current source's epochs count every window it read, before the change too
            source = next(s for s in last.sources if s.name == name)
            assert epochs[name] == pytest.approx(len(windows) / ((source.train.num_tokens - 1) // SEQ), abs=1e-4)


def test_past_steps_read_as_they_did_before_the_change(sources):
    before = [("web", 0.7), ("code", 0.3)]
    original = _sampler(before, sources)
    _, last, _, _ = _run([(0, before), (12, [("math", 0.5), ("web", 0.5)])], sources, 20)
    for step in range(12):
        assert np.array_equal(last.global_batch(step).numpy(), original.global_batch(step).numpy())
        assert last.phase_at(step).sources[0].name == sources["web"].name
    with pytest.raises(ValueError, match="step 3 was read by an earlier blend"):
        _sampler([("web", 1.0)], sources, extend_history(first_history(_identity(before, sources), BATCH),
                                                         _identity([("web", 1.0)], sources), 5, BATCH)).rows(3)


def test_the_change_is_described_for_the_summary(sources):
    history = extend_history(first_history(_identity([("web", 0.7), ("code", 0.3)], sources), BATCH),
                             _identity([("web", 0.4), ("math", 0.6)], sources), 10, BATCH)
    line = describe_change(history, {sources["web"].name: 100})
    assert line.startswith("the blend changes at step 10: ")
    assert f"{sources['web'].name} weight 0.7 -> 0.4 (continues at 0.5600 epochs)" in line  # 56 of 100 read
    assert f"{sources['math'].name} added with weight 0.6" in line and f"{sources['code'].name} removed" in line
    assert describe_change(history[:1], {}) is None
