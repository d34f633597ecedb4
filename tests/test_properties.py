"""Property-based tests (hypothesis): no input makes the library fail in an unplanned way.

1. Random AttentionConfig x shapes x mask x rotary x sequence parallelism, at p = 1, 2 and 4: either
   a ValueError that names an offending value, or output and input gradient equal to the independent
   single-device reference. Any other exception fails. Four ranks stay up for the whole module
   (tests/rank_pool.py) and run each example in tensor-parallel groups of 1, 2 and 4 ranks, so an
   example costs milliseconds, not a process start.
2. Random mutations of configs/gpt_tiny.yaml (keys deleted, values replaced by random scalars,
   strings, negatives, NaN, lists; unknown and duplicated keys; stray characters): `load_config` +
   `validate` accept them or raise ValueError (ConfigError), nothing else; and refused mutants given
   to scripts/pretrain.py exit with status 2 and `config error:`, never with a traceback.

The `slow` variants (`python -m pytest -q -m slow`) draw many more examples: long fuzzing.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import parallel_attention as pa
from parallel_attention import load_config
from parallel_attention.training import PretrainConfig
from parallel_attention.check.reference import reference_attention
from rank_pool import RankPool
from launch import run_command

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "gpt_tiny.yaml"
SECTIONS = [f.name for f in dataclasses.fields(PretrainConfig)]
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LONG = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# float32 module vs float64 reference, as in test_attention_equivalence.py: rounding errors sit near
# 1e-6 of the largest value; a wrong slice, head, mask or position gives errors of order 1.
REL_TOL = 1e-5
TP_SIZES = (1, 2, 4)


# ------------------------------------------------------------------------------------ attention
# (setting, value) that AttentionConfig must refuse at every p, whatever else is drawn
FAULTS = [("hidden_size", 0), ("hidden_size", -3), ("num_heads", 0), ("num_kv_heads", 0), ("num_kv_heads", 3),
          ("head_dim", 0), ("rope_theta", 0.0), ("rope_theta", -1.0), ("attention_dropout", 1.0),
          ("attention_dropout", -0.5), ("attention_kernel", "flash3")]


@st.composite
def attention_cases(draw):
    """An AttentionConfig with an input shape, a mask kind, position ids and a data seed. The config is
    valid at p = 1 (heads that p = 2 or 4 may not divide; head_dim odd, or not dividing hidden_size,
    when no rotary needs it even) unless a fault from FAULTS is drawn; hypothesis shrinks towards none."""
    num_heads = draw(st.sampled_from([4, 8, 2, 1, 6, 3]))  # divisible by every p first: shrinking keeps it
    rotary, d = draw(st.booleans()), draw(st.integers(1, 6))
    config = dict(hidden_size=num_heads * d, num_heads=num_heads, head_dim=None, rotary=rotary,
                  num_kv_heads=draw(st.sampled_from([None] + [k for k in (1, 2, 3, 4) if num_heads % k == 0])),
                  qkv_bias=draw(st.booleans()), out_bias=draw(st.booleans()), causal=draw(st.booleans()),
                  rope_theta=draw(st.sampled_from([10000.0, 500.0])), attention_dropout=0.0,
                  attention_kernel=draw(st.sampled_from(["auto", "sdpa", "math"])))
    sequence_parallel = draw(st.booleans())  # the layout: ParallelSelfAttention's argument, not the config's
    if rotary and d % 2 or draw(st.booleans()):  # an explicit head_dim, unrelated to hidden_size / num_heads
        config.update(hidden_size=draw(st.integers(1, 20)), head_dim=draw(st.sampled_from([2, 4, 6]) if rotary
                                                                           else st.integers(1, 7)))
    fault = draw(st.sampled_from([None] * len(FAULTS) + FAULTS))  # valid at p = 1 half of the time
    if fault is not None:
        config[fault[0]] = fault[1]
    s = draw(st.sampled_from([4, 8])) if sequence_parallel else draw(st.integers(1, 9))  # SP: p divides s
    return dict(config=config, sequence_parallel=sequence_parallel, s=s,
                b=draw(st.integers(1, 3)), mask=draw(st.sampled_from([None, "padding", "pattern"])),
                positions=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)))


def _inputs(case, cfg):
    """Weights (float64, scale 0.3), input, upstream gradient, mask and position ids, the same on every rank."""
    s, b = case["s"], case["b"]
    torch.manual_seed(case["seed"])
    x = torch.randn(s, b, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(s, b, cfg.hidden_size, dtype=torch.float64)
    mask = {None: None, "padding": torch.rand(b, 1, 1, s) < 0.7, "pattern": torch.rand(b, 1, s, s) < 0.7}[case["mask"]]
    positions = torch.randint(0, 2 * s, (b, s)) if case["positions"] else None
    return x, upstream, mask, positions


def _compare(module, cfg, case) -> dict[str, float]:
    p, rank = module.tp_size, module.tp_rank
    x, upstream, mask, positions = _inputs(case, cfg)
    weights = {k: (torch.randn(v.shape, dtype=torch.float64) * 0.3) for k, v in module.canonical_state_dict().items()}
    module.load_canonical_state_dict({k: v.float() for k, v in weights.items()})
    ref = reference_attention(x, weights, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.causal, mask,
                              cfg.rotary, positions, cfg.rope_theta)
    ref.backward(upstream)
    chunk = (lambda t: t.chunk(p, dim=0)[rank]) if module.sequence_parallel else (lambda t: t)
    x_in = chunk(x.detach()).float().requires_grad_()
    out = module(x_in, mask, positions)
    out.backward(chunk(upstream).float())

    def rel(actual, expected):  # relative to the largest value, or absolute below 1 (all-masked rows give 0)
        return ((actual.double() - expected).abs().max() / max(expected.abs().max().item(), 1.0)).item()

    return {"output": rel(out.detach(), chunk(ref.detach())), "input_grad": rel(x_in.grad, chunk(x.grad))}


_TP_GROUPS: dict[int, object] = {}


def _tp_group(p: int):
    """This rank's block of p consecutive ranks, created once per process (new_group is collective:
    every rank creates every block, in the same order)."""
    if p not in _TP_GROUPS:
        rank = torch.distributed.get_rank()
        for start in range(0, torch.distributed.get_world_size(), p):
            group = torch.distributed.new_group(list(range(start, start + p)))
            if start <= rank < start + p:
                _TP_GROUPS[p] = group
    return _TP_GROUPS[p]


def _run_case(case, p):
    """("refused", message) | ("compared", errors) | ("crashed", traceback) at tensor-parallel size p."""
    try:
        cfg = pa.AttentionConfig(**case["config"])
        module = pa.ParallelSelfAttention(cfg, tp_group=_tp_group(p), sequence_parallel=case["sequence_parallel"])
    except ValueError as error:
        return "refused", str(error)
    except Exception:
        return "crashed", traceback.format_exc()
    try:
        return "compared", _compare(module, cfg, case)
    except Exception:
        return "crashed", traceback.format_exc()


def attention_case_worker(case):
    """The case at p = 1, 2 and 4 on this rank of a world of 4: {p: outcome}."""
    return {p: _run_case(case, p) for p in TP_SIZES}


def _named_values(case, p) -> list[str]:
    """`name=value` spellings a refusal may use for the drawn (or derived) settings and p."""
    config = dict(case["config"])
    if config["num_kv_heads"] is None:
        config["num_kv_heads"] = config["num_heads"]
    if config["head_dim"] is None and config["num_heads"] > 0:
        config["head_dim"] = config["hidden_size"] // config["num_heads"]
    config["tensor_parallel_size"] = p
    return [f"{k}={v}" for k, v in config.items()] + [f"{k}={v!r}" for k, v in config.items()]


@pytest.fixture(scope="module")
def rank_pool():
    pool = RankPool(max(TP_SIZES))
    yield pool
    pool.close()


def check_attention_case(pool, case):
    per_rank = pool.run(attention_case_worker, case)
    refused_at_p1 = per_rank[0][1][0] == "refused"
    event(f"outcome at p=1, 2, 4: {[per_rank[0][p][0] for p in TP_SIZES]}")
    for rank, outcomes in enumerate(per_rank):
        for p, (outcome, detail) in outcomes.items():
            where = f"p={p} rank {rank} case {case}"
            assert outcome != "crashed", f"{where}: an exception other than ValueError:\n{detail}"
            if outcome == "refused":
                assert any(named in detail for named in _named_values(case, p)), f"{where}: {detail!r} names no value"
                assert refused_at_p1 or f"tensor_parallel_size={p}" in detail, f"{where}: {detail!r}"
            else:
                assert not refused_at_p1, f"{where}: refused at p=1 but accepted here"
                assert all(e <= REL_TOL for e in detail.values()), f"{where}: relative errors {detail}"


@FAST
@given(case=attention_cases())
def test_attention_matches_reference_or_refuses_naming_the_value(rank_pool, case):
    check_attention_case(rank_pool, case)


@pytest.mark.slow
@LONG
@given(case=attention_cases())
def test_attention_long_fuzzing(rank_pool, case):
    check_attention_case(rank_pool, case)


# ------------------------------------------------------------------------------------ configs
BASE = yaml.safe_load(TINY.read_text())
KEYS = [(section, key) for section, values in dataclasses.asdict(PretrainConfig()).items() for key in values]
VALUES = st.one_of(st.integers(-3, 3), st.integers(), st.floats(), st.booleans(), st.none(), st.text(max_size=6),
                   st.sampled_from(["nan", ".nan", "-.inf", "1e400", "auto", "none", "stdlib", "", "byte"]),
                   st.lists(st.integers(-2, 2), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                             max_size=1))
MUTATIONS = st.one_of(
    st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    st.tuples(st.just("delete_section"), st.sampled_from(SECTIONS)),
    st.tuples(st.just("set"), st.sampled_from(KEYS), VALUES),
    st.tuples(st.just("set_section"), st.sampled_from(SECTIONS), VALUES),
    st.tuples(st.just("add_unknown"), st.sampled_from(SECTIONS), st.text(min_size=1, max_size=6), VALUES),
    st.tuples(st.just("duplicate_line"), st.integers(0, 10 ** 6)),
    st.tuples(st.just("insert_char"), st.integers(0, 10 ** 6), st.sampled_from(list(":[]{}-'\"\t&*!%@#|>, \n"))),
)


def mutate(mutations) -> str:
    """The text of gpt_tiny.yaml after `mutations`: mapping edits first, then edits of the text."""
    data = copy.deepcopy(BASE)
    for kind, *args in mutations:
        if kind == "delete" and isinstance(data.get(args[0][0]), dict):
            data[args[0][0]].pop(args[0][1], None)
        elif kind == "delete_section":
            data.pop(args[0], None)
        elif kind == "set" and isinstance(data.setdefault(args[0][0], {}), dict):
            data[args[0][0]][args[0][1]] = args[1]
        elif kind == "set_section":
            data[args[0]] = args[1]
        elif kind == "add_unknown" and isinstance(data.setdefault(args[0], {}), dict):
            data[args[0]][args[1]] = args[2]
    text = yaml.safe_dump(data, sort_keys=False)
    for kind, *args in mutations:
        lines = text.splitlines(keepends=True)
        if kind == "duplicate_line":  # a key line repeated: a duplicate key, unless it was a list item
            i = args[0] % len(lines)
            text = "".join(lines[:i + 1] + lines[i:])
        elif kind == "insert_char":
            i = args[0] % (len(text) + 1)
            text = text[:i] + args[1] + text[i:]
    return text


def load_mutant(text: str) -> str | None:
    """None when the mutant is accepted, else the refusal; any other exception propagates (and fails)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mutant.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            load_config(path).validate(2)
        except ValueError as error:  # ConfigError is a ValueError
            message = str(error)
            assert any(name in message for name in [str(path), "=", *SECTIONS]), f"{message!r} names nothing"
            return message
    return None


@FAST
@given(mutations=st.lists(MUTATIONS, min_size=1, max_size=3))
def test_yaml_mutations_are_accepted_or_refused_as_config_errors(mutations):
    load_mutant(mutate(mutations))


@pytest.mark.slow
@LONG
@given(mutations=st.lists(MUTATIONS, min_size=1, max_size=4))
def test_yaml_mutations_long_fuzzing(mutations):
    load_mutant(mutate(mutations))


REFUSED_MUTANTS = {  # one of each kind of refusal; each is checked to be refused in-process first
    "negative lr": [("set", ("optimizer", "lr"), -0.5)],
    "duplicate key": [("duplicate_line", 2)],
    "YAML syntax": [("insert_char", 30, "[")],
}


@pytest.mark.parametrize("name", REFUSED_MUTANTS)
def test_refused_mutants_exit_2_from_pretrain_without_traceback(name, tmp_path):
    text = mutate(REFUSED_MUTANTS[name])
    assert load_mutant(text) is not None, f"{name}: the mutant was accepted"
    (tmp_path / "mutant.yaml").write_text(text, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    done = run_command([sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--config", "mutant.yaml"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("config error: "), (name, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
