"""FP8 in transformers models made parallel by parallelize(): under fp8_linears, the layers' column- and
row-parallel linears multiply in FP8 (the head stays in float32), so that every family fixture at tp 2 gives tp 1's
FP8 logits, loss and gradient norm, in both recipes, as docs/fp8.md promises (tests/test_fp8_training.py covers
GPTModel's layouts).

Measured: tp 2's logits within 3e-8 of tp 1's, while FP8 moves them 4e-3 to 4e-2 from float32 (asserted above 1e-3,
so FP8 was really on). The MAX all-reduces of split tensors' amaxes are shown to matter in tests/test_fp8_layouts.py
on the same linears: with power-of-two scales a scale only changes what lies near e4m3's range ends, which these
random fixtures rarely reach (so tensorwise and rowwise give them equal numbers too)."""

from __future__ import annotations

import copy

import pytest
import torch

import parallel_attention as pa
from distributed import run_distributed
from hf_fixtures import FAMILIES, VOCAB, build
from parallel_attention.tensor_parallel.linear_precision import fp8_linears

pytest.importorskip("transformers")

RECIPES = ("tensorwise", "rowwise")


def _forward_backward(model, ids, recipe: str) -> tuple[torch.Tensor, float, float]:
    """(logits, loss, the gradient's global 2-norm) of one forward and backward under `recipe` ("none": float32)."""
    model.zero_grad(set_to_none=True)
    with fp8_linears(recipe, "cpu"):
        out = model(ids, labels=ids)
        out.loss.backward()
    return out.logits.detach(), out.loss.item(), float(pa.clip_grad_norm_(model, 1e9))


def _worker() -> dict:
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    results = {}
    for name in FAMILIES:
        model = pa.parallelize(copy.deepcopy(build(name))).train()
        for recipe in ("none", *RECIPES):
            results[name, recipe] = _forward_backward(model, ids, recipe)
    return results


def test_parallelized_models_train_in_fp8_as_one_process():
    (one,) = run_distributed(_worker, 1, 1, timeout=300)
    two = run_distributed(_worker, 2, 2, timeout=300)[0]
    for name in FAMILIES:
        high_logits = one[name, "none"][0]
        for recipe in RECIPES:
            (logits, loss, norm), (expected, expected_loss, expected_norm) = two[name, recipe], one[name, recipe]
            fp8_shift = (expected - high_logits).abs().max().item()
            gap = (logits - expected).abs().max().item()
            assert fp8_shift > 1e-3, (name, recipe, fp8_shift)  # the layers did multiply in FP8
            assert gap <= 1e-6, (name, recipe, gap, fp8_shift)  # float32's summation order, not FP8's rounding
            assert loss == pytest.approx(expected_loss, rel=1e-6), (name, recipe)
            assert norm == pytest.approx(expected_norm, rel=1e-4), (name, recipe)
