"""scripts/pipeline_timeline.py on made-up steps (no run needed): every part of every stage's row is drawn in a
colour the legend explains, W and its legend appear only where the schedule has weight gradients, and no block's
label overlaps another or leaves its block. (A real run's picture: tests/test_pipeline.py.)"""

from __future__ import annotations

import importlib.util

import pytest

from launch import ROOT
from parallel_attention.pipeline.schedules import build_schedule

_SPEC = importlib.util.spec_from_file_location("pipeline_timeline", ROOT / "scripts" / "pipeline_timeline.py")
timeline = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(timeline)

SECONDS = {"F": 1e-3, "B": 2e-3, "W": 1e-3}


def _records(schedule: str, p: int = 2, m: int = 8) -> list[dict]:
    """Each stage's events as the trainer writes them: stage s starts s ms late and waits 0.5 ms for its first
    input, actions take 1-2 ms (micro-batch 3's forward only 0.02 ms: too short for its label), with 0.1 ms of host
    work between them."""
    records = []
    for s in range(p):
        events, at = [["wait", 0.0, 5e-4]], 5e-4
        for action in build_schedule(schedule, p, m, s, 1):
            at += 1e-4
            took = 2e-5 if (action.kind, action.micro) == ("F", 3) else SECONDS[action.kind]
            events.append([str(action), at, at + took])
            at += took
        records.append({"step": 5, "stage": s, "start": 1000.0 + s * 1e-3, "events": events})
    return records


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_every_part_of_a_row_is_explained_and_w_only_where_it_exists(schedule):
    records = _records(schedule)
    drawn = timeline.spans(records)
    end = max(d[4] for d in drawn)
    for stage in (0, 1):
        row = sorted((d for d in drawn if d[0] == stage), key=lambda d: d[3])
        assert row[0][3] == 0 and row[-1][4] == pytest.approx(end)
        assert all(a[4] == pytest.approx(b[3]) for a, b in zip(row, row[1:]))  # no hole in the row
    assert {d[1] for d in drawn} <= timeline.KINDS.keys()
    fig = timeline.figure(records, 5)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(legend) == len({d[1] for d in drawn})  # each colour shown is explained, and only those
    assert any("between actions" in t for t in legend) and any("outside this stage" in t for t in legend)
    assert any(t.startswith("weight gradient") for t in legend) == (schedule == "zero_bubble")


def test_labels_fit_their_blocks_and_never_overlap():
    records = _records("zero_bubble")
    fig = timeline.figure(records, 5)
    ax, renderer = fig.axes[0], fig.canvas.get_renderer()
    blocks = {(stage, label): (start, end) for stage, _, label, start, end in timeline.spans(records) if label}
    boxes = []
    for text in ax.texts:
        stage, label = int(text.get_position()[1]), text.get_text()
        start, end = blocks[(stage, label)]
        left, right = ax.transData.transform([(start * 1e3, stage), (end * 1e3, stage)])[:, 0]
        box = text.get_window_extent(renderer)
        assert left <= box.x0 and box.x1 <= right, (stage, label)
        boxes.append(box)
    labels = {(int(t.get_position()[1]), t.get_text()) for t in ax.texts}
    assert (0, "F3") not in labels and {(0, "F2"), (1, "B7"), (1, "W7")} <= labels  # 0.02 ms leaves no room
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
