"""The pipeline's pure parts, in-process: the schedules' action lists, the balanced split, and the config checks
that refuse a pipeline before any process group exists."""

from __future__ import annotations

import itertools

import pytest

from parallel_attention.pipeline.layout import StageCosts, balanced_split, rank_stage, stage_layer_counts
from parallel_attention.pipeline.schedules import SCHEDULES, bubble_formula, build_schedule
from parallel_attention.training.config.schema import ConfigError, load_config

CASES = [(name, p, m, 2 if name == "interleaved_1f1b" else 1) for name in SCHEDULES
         for p, m in ((2, 4), (4, 4), (4, 8), (3, 9)) if name != "interleaved_1f1b" or m % p == 0]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_each_rank_runs_every_forward_and_backward_once_in_dependency_order(name, p, m, v):
    for s in range(p):
        actions = build_schedule(name, p, m, s, v)
        done = {}
        for k, a in enumerate(actions):
            assert (a.kind, a.chunk, a.micro) not in done, (name, s, a)
            done[(a.kind, a.chunk, a.micro)] = k
            if a.kind == "B":
                assert ("F", a.chunk, a.micro) in done  # a backward follows its own forward
            if a.kind == "W":
                assert ("B", a.chunk, a.micro) in done  # a weight gradient follows its input gradient
        kinds = {"F", "B"} | ({"W"} if name == "zero_bubble" else set())
        assert set(done) == {(k, c, i) for k in kinds for c in range(v) for i in range(m)}


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16)])
def test_1f1b_holds_at_most_p_micro_batches_on_the_first_stage_and_gpipe_holds_all(p, m):
    def peak_in_flight(name):
        held = peak = 0
        for a in build_schedule(name, p, m, 0):
            held += {"F": 1, "B": -1}.get(a.kind, 0)
            peak = max(peak, held)
        return peak
    assert peak_in_flight("1f1b") == p and peak_in_flight("zero_bubble") == p and peak_in_flight("gpipe") == m


def test_the_schedules_order_is_consistent_between_neighbours():
    """Stage s sends its forward outputs in its order of forwards; stage s+1 receives them in its order: the same
    sequence of micro-batches (and of gradients the other way), or a message would land in the wrong buffer."""
    for name, p, m, v in CASES:
        orders = [build_schedule(name, p, m, s, v) for s in range(p)]
        for s in range(p - 1):
            sent = [(a.chunk, a.micro) for a in orders[s] if a.kind == "F"]
            received = [(a.chunk, a.micro) for a in orders[s + 1] if a.kind == "F"]
            assert sent == received, (name, s)
            assert [(a.chunk, a.micro) for a in orders[s + 1] if a.kind == "B"] == \
                [(a.chunk, a.micro) for a in orders[s] if a.kind == "B"], (name, s)


def test_bubble_formulas():
    assert bubble_formula("1f1b", 4, 8) == pytest.approx(3 / 11) == bubble_formula("gpipe", 4, 8)
    assert bubble_formula("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_formula("zero_bubble", 4, 8) == pytest.approx(3 / 27)


def test_the_balanced_split_counts_the_embedding_and_the_head_and_builds_every_layer_once():
    assert balanced_split(30, 4) == [7, 8, 8, 7]  # Megatron-LM #1304: 30 layers at pp 4 must all be built
    for layers, stages in itertools.product(range(1, 40), range(1, 9)):
        if layers >= stages:
            split = balanced_split(layers, stages)
            costs = [n + (i == 0) + (i == stages - 1) for i, n in enumerate(split)]
            assert sum(split) == layers and min(split) >= 1 and max(costs) - min(costs) <= 2, (layers, stages)
    assert rank_stage(6, 2, 2, None, 0).describe() == "layers 0-0, 3-4 + embedding"
    stage = rank_stage(6, 2, 2, None, 1)
    assert stage.chunks == ((1, 3), (5, 6)) and stage.has_head and not stage.has_embedding


def test_the_balanced_split_weighs_the_output_layer_and_loss_by_their_flops():
    """h 128 and an 8,192-token vocabulary: the output layer and loss cost about 4.6 layers, so the last of two
    stages takes 2 of 8 layers (counted as one layer it took 4, and its forwards ran ~3x the first stage's)."""
    from parallel_attention.transformer.model_config import ModelConfig

    costs = StageCosts.of(ModelConfig(vocab_size=8192, hidden_size=128, num_layers=8, num_heads=4), 128)
    assert 4.5 < costs.head / costs.layer < 4.7 and costs.embedding < costs.layer / 100
    split = balanced_split(8, 2, costs)
    assert split == [6, 2]
    stage_costs = [costs.of_stage(k, 2, n) for k, n in enumerate(split)]
    assert max(stage_costs) - min(stage_costs) <= costs.layer  # as even as whole layers allow


@pytest.mark.parametrize("layers", [[3, 2], [2, 2, 2], [5, 0], [1, 3]])
def test_an_explicit_split_must_build_every_layer_exactly_once(layers):
    if layers == [3, 2]:
        assert stage_layer_counts(5, 2, 1, layers) == [3, 2]
        return
    with pytest.raises(ValueError, match="pipeline_layers"):
        stage_layer_counts(5, 2, 1, layers)


def _config(*overrides: str):
    return load_config(None, ["--model.num_layers=4", "--training.global_batch_size=8", "--training.micro_batch_size=2",
                              "--data.source=stdlib", *overrides])


@pytest.mark.parametrize("overrides,world,words", [
    (["--parallel.pipeline_parallel_size=4", "--training.micro_batch_size=4"], 4, "at least 4 micro-batches"),
    (["--parallel.pipeline_parallel_size=2", "--parallel.pipeline_layers=[1,2]"], 2, "pipeline_layers=[1, 2]"),
    (["--parallel.pipeline_parallel_size=2", "--parallel.virtual_pipeline_stages=2"], 2, "interleaved_1f1b"),
    (["--parallel.pipeline_parallel_size=8"], 8, "cannot fill 8 pipeline stages"),
    (["--parallel.pipeline_parallel_size=2", "--parallel.pipeline_schedule=zero_bubble",
      "--parallel.zero_stage=3"], 4, "zero_stage=3"),
    (["--parallel.pipeline_parallel_size=3"], 2, "does not divide the world size 2"),
])
def test_a_pipeline_that_cannot_run_is_refused_before_any_process_group(overrides, world, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        _config(*overrides).validate(world)


def test_a_valid_pipeline_config_passes():
    _config("--parallel.pipeline_parallel_size=2", "--parallel.pipeline_schedule=interleaved_1f1b",
            "--parallel.virtual_pipeline_stages=2").validate(2)


def test_a_resume_that_changes_the_split_says_so_and_how_to_keep_it():
    """A pp 2 checkpoint whose stages hold layers [0, 1] and [2, 3] (an earlier release's split, which weighed the
    output layer as one layer), resumed where the split weighed by FLOPs gives [3, 1]."""
    from parallel_attention.training.run.resume import layout_change

    cfg = _config("--parallel.pipeline_parallel_size=2", "--model.vocab_size=8192", "--model.hidden_size=128")
    shapes = {f"tp00_pp0{s}": {f"layers.{i}.input_norm.weight": {} for i in range(2 * s, 2 * s + 2)} for s in (0, 1)}
    saved = {"tensor_parallel_size": 1, "world_size": 2, "model_shapes": shapes, "config": cfg.to_dict()}
    assert layout_change(saved, cfg, 2) == (
        "layout changed: written at tp 1 x pp 2 (layers 0-1 | 2-3), 2 ranks, resharded to tp 1 x pp 2 (layers 0-2 | "
        "3), 2 ranks; parallel.pipeline_layers=[2, 2] keeps the checkpoint's split")
    kept = _config("--parallel.pipeline_parallel_size=2", "--model.vocab_size=8192", "--model.hidden_size=128",
                   "--parallel.pipeline_layers=[2,2]")
    assert layout_change(saved, kept, 2) is None
    one_process = {"tensor_parallel_size": 1, "world_size": 1, "model_shapes": {"tp00": shapes["tp00_pp00"]}}
    assert layout_change(one_process, cfg, 2).endswith("resharded to tp 1 x pp 2 (layers 0-2 | 3), 2 ranks")
