"""A blend that changes mid-run (checkpoint.allow_data_change): the run's history of blends, and each source's own
epochs carried across a change.

The history is a list of phases, each recorded in every checkpoint (data identity's `blend_history`):

    {"step": S, "global_batch_size": B, "sources": [{"path", "sha256", "weight", "key", "first_draw"}, ...]}

Phase p trains steps [S_p, S_p+1): the k-th sample from S_p on is sample k of its own blend order (batches.py), and
source j's d-th draw there reads window `first_draw_j + d` of that source's epochs, in the window order named by
`key_j`: the source's index in the blend it first appeared in. So a source continues its epoch where it stopped (no
window repeats before its epoch ends), a removed source is no longer drawn, an added one starts at its first
window, and an unchanged blend is one phase from step 0 (keys 0..m-1, nothing drawn before): today's batches. A
source is known by the sha256 of its content, as the data identity knows it. The batch of any past step is then a
pure function of the run's newest checkpoint and its config, which is how inspect_data.py reads past steps.
"""

from __future__ import annotations

import os
import sys

from .batches import GlobalBatchSampler, describe_blend, draws_before

__all__ = ["continue_blend", "continue_run_blend", "describe_change", "extend_history", "first_history",
           "read_history", "windows_read"]


def first_history(identity: dict, global_batch_size: int) -> list[dict]:
    """The history of a run whose blend never changed (also that of a checkpoint written before histories)."""
    return [{"step": 0, "global_batch_size": global_batch_size,
             "sources": [{"path": s["path"], "sha256": s["sha256"], "weight": s["weight"], "key": j, "first_draw": 0}
                         for j, s in enumerate(identity["sources"])]}]


def windows_read(history: list[dict], step: int) -> dict[int, int]:
    """{key: windows of that source read by the steps before `step`}, over every phase up to it."""
    read: dict[int, int] = {}
    for phase, following in zip(history, [*history[1:], None]):
        if phase["step"] >= step and phase is not history[0]:
            break
        end = step if following is None else min(step, following["step"])
        weights = [s["weight"] for s in phase["sources"]]
        drawn = draws_before(weights, max(0, end - phase["step"]) * phase["global_batch_size"])
        for source, count in zip(phase["sources"], drawn):
            read[source["key"]] = source["first_draw"] + int(count)
    return read


def extend_history(history: list[dict], identity: dict, step: int, global_batch_size: int) -> list[dict]:
    """The history with this run's blend (`identity`'s sources) from `step` on: unchanged if it is the last
    phase's; else a new phase whose sources continue their windows (a new source starts at 0). Another
    global batch size alone starts no phase: an unchanged blend draws as every earlier release did, its batch
    size the config's."""
    last = history[-1]
    if step == 0:  # nothing was read yet: a fresh start
        return first_history(identity, global_batch_size)
    now = [(s["sha256"], s["weight"]) for s in identity["sources"]]
    if now == [(s["sha256"], s["weight"]) for s in last["sources"]]:
        return [*history[:-1], {**last, "global_batch_size": global_batch_size}]
    read, keys = windows_read(history, step), {}
    for phase in history:
        keys.update({s["sha256"]: s["key"] for s in phase["sources"]})
    next_key = 1 + max(keys.values(), default=-1)
    sources = []
    for s in identity["sources"]:
        if s["sha256"] not in keys:
            keys[s["sha256"]], next_key = next_key, next_key + 1
        key = keys[s["sha256"]]
        sources.append({"path": s["path"], "sha256": s["sha256"], "weight": s["weight"], "key": key,
                        "first_draw": read.get(key, 0)})
    kept = [phase for phase in history if phase["step"] < step]  # a phase begun at `step` is replaced
    return [*kept, {"step": step, "global_batch_size": global_batch_size, "sources": sources}]


def read_history(manifest: dict | None, identity: dict, global_batch_size: int) -> list[dict]:
    """This run's history: the checkpoint's (`manifest`, None for a fresh start) extended by this run's blend."""
    saved = None if manifest is None else manifest["extra"].get("data_identity")
    if not saved:
        return first_history(identity, global_batch_size)
    history = saved.get("blend_history") or first_history(saved, global_batch_size)
    return extend_history(history, identity, manifest["step"], global_batch_size)


def continue_blend(sampler: GlobalBatchSampler, history: list[dict], open_phase=None) -> None:
    """Set `sampler` (the run's current blend) to continue the history's last phase; `open_phase(phase)` builds
    an earlier phase's sampler (inspect_data.py) when one of its steps is asked for."""
    if sampler.sampling != "epochs":
        return  # random windows draw with replacement: nothing to continue
    last, cache = history[-1], {}

    def earlier(step: int) -> GlobalBatchSampler:
        index = max(i for i, phase in enumerate(history) if phase["step"] <= step)
        if index not in cache:
            if open_phase is None:
                raise ValueError(f"step {step} was read by an earlier blend of this run, whose sources are not open")
            phase = history[index]
            cache[index] = open_phase(phase)
            cache[index].continue_at(phase["step"], [s["key"] for s in phase["sources"]],
                                     [s["first_draw"] for s in phase["sources"]], earlier)
        return cache[index]

    sampler.continue_at(last["step"], [s["key"] for s in last["sources"]], [s["first_draw"] for s in last["sources"]],
                        earlier if len(history) > 1 else None)


def continue_run_blend(cfg, sampler: GlobalBatchSampler, identity: dict, manifest: dict | None) -> None:
    """At a run's start or resume: record its blend history in `identity` (every checkpoint keeps it), set the
    sampler to continue it, and say so when this resume changes the blend."""
    history = read_history(manifest, identity, cfg.training.global_batch_size)
    identity["blend_history"] = history
    continue_blend(sampler, history)
    if manifest is not None and len(history) > 1 and history[-1]["step"] == manifest["step"] and \
            cfg.checkpoint.allow_data_change:  # else check_identity refuses the change
        say_change(history, sampler, cfg.training.max_steps)


def describe_change(history: list[dict], windows_per_source: dict[str, int]) -> str | None:
    """One line for the run's summary when its last phase changed the blend at the resume: each source's weight
    before and after, and the epoch it continues from; None when the blend is the run's first."""
    if len(history) < 2:
        return None
    before, after = history[-2], history[-1]
    old = {s["sha256"]: s for s in before["sources"]}
    parts = []
    for s in after["sources"]:
        was = old.pop(s["sha256"], None)
        epochs = s["first_draw"] / max(windows_per_source.get(s["path"], 1), 1)
        parts.append(f"{s['path']} weight {was['weight']:g} -> {s['weight']:g}" if was else
                     f"{s['path']} added with weight {s['weight']:g}")
        parts[-1] += f" (continues at {epochs:.4f} epochs)"
    parts += [f"{s['path']} removed (weight {s['weight']:g})" for s in old.values()]
    return f"the blend changes at step {after['step']}: " + "; ".join(parts)


def say_change(history: list[dict], sampler: GlobalBatchSampler, max_steps: int) -> None:
    """Print describe_change on rank 0's stderr, if the blend changed, with each source's epochs by `max_steps`
    (the summary printed before the resume counted them as if the new blend had run from step 0)."""
    windows = {source.name: w.num_windows for source, w in zip(sampler.sources, sampler.windows)}
    line = describe_change(history, windows)
    if line is not None and os.environ.get("RANK", "0") == "0":
        print(f"{line}; by step {max_steps}: {describe_blend(sampler, max_steps)}", file=sys.stderr, flush=True)
