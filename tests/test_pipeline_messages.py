"""The runner's messages replayed through a model of NCCL's semantics (`pipeline/nccl_model.py`): the plan the runner
follows (`pipeline/messages.py`) finishes at every schedule and size, and the same model finds the deadlock of the
plan it replaced (interleaved 1f1b with more micro-batches than stages, messages larger than NCCL's buffers); the
buffers a stage holds for its messages, which the run summary counts, do not grow with the micro-batches. Pure
Python, in-process."""

from __future__ import annotations

import pytest

from launch import ROOT

from parallel_attention.pipeline.messages import buffers_in_flight, incoming, moments, outgoing
from parallel_attention.pipeline.nccl_model import MismatchedMessage, Post, Wait, replay, runner_program
from parallel_attention.pipeline.schedules import SCHEDULES, build_schedule
from parallel_attention.training.config.schema import load_config
from parallel_attention.training.run.pipeline_summary import buffer_row

CASES = [(name, p, m, v) for name in (*SCHEDULES, "forward_only") for p in (2, 3, 4, 8) for v in (1, 2)
         for m in range(1 if name == "forward_only" else p, 4 * p + 1)
         if (v == 2) == (name == "interleaved_1f1b") or (name == "forward_only")
         if name != "interleaved_1f1b" or m % p == 0]


def _programs(plan_of, name: str, p: int, m: int, v: int) -> dict:
    return {s: plan_of(build_schedule(name, p, m, s, v), s, p, v) for s in range(p)}


def _runner(actions, s, p, v):
    return runner_program(moments(actions, s, p, v), s)


def _replaced(actions, s, p, v):
    """The plan before links (written here, as it ran): one communicator per kind shared by the pipeline group,
    a kind's send and receive of a moment in one group call, each receive waited for before the next action, the
    sends at the end of the step."""
    program, sent = [], []
    for k in range(len(actions) + 1):
        send = outgoing(actions[k - 1], s, p, v) if k > 0 else None
        receive = incoming(actions[k], s, p, v) if k < len(actions) else None
        for kind in ("activation", "gradient"):
            ops = [("send", send.link.target, send)] if send is not None and send.link.kind == kind else []
            ops += [("recv", receive.link.source, receive)] if receive is not None and receive.link.kind == kind else []
            if ops:
                program.append(Post(kind, tuple(ops)))
        sent += [send] if send is not None else []
        program += [Wait((receive,))] if receive is not None else []
    return program + [Wait(tuple(sent))]


def test_every_schedule_finishes_under_nccl_and_gloo_semantics():
    assert len(CASES) > 300
    for name, p, m, v in CASES:
        programs = _programs(_runner, name, p, m, v)
        for in_order in (True, False):  # NCCL's streams, gloo's independent operations
            deadlock = replay(programs, in_order)
            assert deadlock is None, f"{name} p {p} m {m} v {v} in_order {in_order}:\n{deadlock.text}"


def test_the_model_finds_the_deadlock_of_the_plan_it_replaced():
    found = {(name, p, m, v) for name, p, m, v in CASES if replay(_programs(_replaced, name, p, m, v)) is not None}
    expected = {(name, p, m, v) for name, p, m, v in CASES if name == "interleaved_1f1b" and m > p}
    assert found == expected
    deadlock = replay(_programs(_replaced, "interleaved_1f1b", 2, 4, 2))
    assert set(deadlock.stuck) == {0, 1} and "stream (0, 'gradient')" in deadlock.text, deadlock.text
    assert replay(_programs(_replaced, "interleaved_1f1b", 2, 4, 2), in_order=False) is None  # gloo: no streams


@pytest.mark.parametrize("name,p,v", [("1f1b", 4, 1), ("interleaved_1f1b", 4, 2), ("zero_bubble", 4, 1),
                                      ("gpipe", 2, 1)])
def test_a_stage_holds_at_most_one_moments_sends_whatever_m(name, p, v):
    """Each send is retired (waited for, its buffer released) exactly once, by the next moment: between two actions
    a stage holds one send beyond what its schedule keeps for its backwards, at m = p and at m = 8p."""
    for m in (p, 8 * p):
        for s in range(p):
            plan, outstanding = moments(build_schedule(name, p, m, s, v), s, p, v), set()
            for moment in plan:
                outstanding |= set(moment.sends)
                assert set(moment.retire) <= outstanding
                outstanding -= set(moment.retire)
                assert len(outstanding) <= 1
            assert not outstanding
            assert sum(len(moment.retire) for moment in plan) == sum(len(moment.sends) for moment in plan)


def test_the_model_matches_by_order_and_sees_a_message_left_over():
    """NCCL matches the k-th send with the k-th receive of a communicator: two messages received in the other order
    land in each other's buffers; a send nobody receives leaves its sender's wait hanging."""
    sender = [Post("link", (("send", 1, "a"),)), Post("link", (("send", 1, "b"),)), Wait(("a", "b"))]
    swapped = [Post("link", (("recv", 0, "b"),)), Post("link", (("recv", 0, "a"),)), Wait(("a", "b"))]
    with pytest.raises(MismatchedMessage, match="the receive of b matched the send of a"):
        replay({0: sender, 1: swapped})
    deadlock = replay({0: sender, 1: swapped[1:2] + [Wait(("a",))]})
    assert deadlock is not None and "never completed: (0, 'send', 'b')" in deadlock.text, deadlock


def test_every_link_carries_one_kind_one_way():
    for name, p, m, v in CASES:
        for s in range(p):
            for moment in moments(build_schedule(name, p, m, s, v), s, p, v):
                for message in moment.sends:
                    assert message.link.source == s
                    step = 1 if message.link.kind == "activation" else -1
                    assert message.link.target == (s + step) % p
                if moment.receive is not None:
                    assert moment.receive.link.target == s


def test_the_buffers_in_flight_do_not_grow_with_m_except_under_gpipe_and_the_summary_counts_them():
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1), ("forward_only", 2)):
        counts = {m: [buffers_in_flight(build_schedule(name, 4, m, s, v), s, 4, v, name != "forward_only")
                      for s in range(4)] for m in (8, 32)}
        assert (counts[8] != counts[32]) == (name == "gpipe"), (name, counts)
    # 1f1b stage s: its p - s - 1 warm-up inputs and the steady state's, a gradient received, a send posted while
    # the one before completes
    assert [buffers_in_flight(build_schedule("1f1b", 4, 16, s), s, 4, 1) for s in range(4)] == [3, 6, 5, 2]
    cfg = load_config(ROOT / "configs" / "llama_70b_pp.yaml")
    row = buffer_row(cfg, cfg.gradient_accumulation_steps(128))["pipeline buffers"]
    assert row.startswith("at most 3, 10, 9, 8, 7, 6, 5, 2 activations in flight on stages 0-7"), row

