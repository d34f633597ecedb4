"""Activation recomputation, full layer and selective (the attention core only), changes no number.

With dropout on at every site, under both dropout RNGs (the tensor-parallel generator, replayed by
the recomputation, and layout-invariant hashed masks, whose coordinates are replayed), the loss and
every gradient equal the run without recomputation bit for bit (float64, same operations in the
same order), at p = 1 and at p = 2 with sequence parallelism. And each step of recomputation keeps
less for backward: full < selective < none (saved-for-backward bytes, `saved_activation_bytes`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed import run_distributed

import parallel_attention as pa
from parallel_attention.checkpointing.compatibility import check_config, check_same_model, model_shape_config
from parallel_attention.tensor_parallel.rng import dropout_coordinates
from parallel_attention.training.activation_memory import saved_activation_bytes
from parallel_attention.transformer import GPTModel, ModelConfig

SETTINGS = {"none": {}, "full": {"recompute_activations": True, "recompute_granularity": "full"},
            "selective": {"recompute_activations": True, "recompute_granularity": "selective"}}
# awkward sizes; GQA 6/2 with rotary so that every path of the attention runs
LLAMA_LIKE = dict(vocab_size=203, hidden_size=36, num_layers=2, num_heads=6, num_kv_heads=2, max_seq_len=16,
                  position_embedding="rotary", activation="swiglu", norm="rmsnorm")


def _loss_and_grads(setting: str, dropout_rng: str, sequence_parallel: bool, kernel: str):
    pa.manual_seed(7)
    cfg = ModelConfig(**LLAMA_LIKE, hidden_dropout=0.2, attention_dropout=0.3, dropout_rng=dropout_rng,
                      attention_kernel=kernel, **SETTINGS[setting])
    model = GPTModel(cfg, sequence_parallel=sequence_parallel, dtype=torch.float64)
    tokens = torch.randint(0, 203, (3, 13), generator=torch.Generator().manual_seed(1))
    with dropout_coordinates(11, 5, 0):  # read by layout-invariant dropout only
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def equal_worker(sequence_parallel: bool) -> list[str]:
    """Names of the (dropout_rng, setting, tensor) whose values differ from no recomputation."""
    differ = []
    # per_rank: SDPA draws its dropout inside the tensor-parallel generator; layout_invariant: explicit
    # probabilities and hashed masks whatever the kernel
    for dropout_rng in ("per_rank", "layout_invariant"):
        ref_loss, ref_grads = _loss_and_grads("none", dropout_rng, sequence_parallel, "sdpa")
        for setting in ("full", "selective"):
            loss, grads = _loss_and_grads(setting, dropout_rng, sequence_parallel, "sdpa")
            where = f"{dropout_rng}/{setting}"
            differ += [f"{where}: loss"] if not torch.equal(loss, ref_loss) else []
            differ += [f"{where}: {n}" for n, g in ref_grads.items() if not torch.equal(grads[n], g)]
    return differ


def test_recomputation_changes_no_loss_and_no_gradient_at_p1():
    differ = equal_worker(False)  # in this process: one rank, no process group
    assert not differ, differ


def test_recomputation_changes_no_loss_and_no_gradient_at_p2_with_sequence_parallelism():
    for differ in run_distributed(equal_worker, 2, 2, True):
        assert not differ, differ


@pytest.mark.parametrize("kernel", ["math", "sdpa"])
def test_each_granularity_keeps_less(kernel):
    saved = {}
    for setting in SETTINGS:
        pa.manual_seed(0)
        model = GPTModel(ModelConfig(**LLAMA_LIKE, attention_kernel=kernel, **SETTINGS[setting]))
        tokens = torch.randint(0, 203, (2, 16), generator=torch.Generator().manual_seed(1))
        saved[setting] = saved_activation_bytes(lambda: model(tokens[:, :-1], tokens[:, 1:]))
    # selective drops what the kernel keeps: the s x s probabilities (math), SDPA's output and logsumexp
    assert saved["full"] < saved["selective"] < saved["none"], saved


def test_an_unknown_granularity_is_refused():
    with pytest.raises(ValueError, match="recompute_granularity='partial'"):
        GPTModel(ModelConfig(**LLAMA_LIKE, recompute_granularity="partial"))


def test_a_checkpoint_resumes_under_another_recompute_setting():
    """The setting is runtime-only: a checkpoint written before the key existed, or with another value, fits."""
    older = dataclasses.asdict(ModelConfig(**LLAMA_LIKE))
    del older["recompute_granularity"]
    manifest = {"config": {"model": older}}
    for setting in SETTINGS.values():
        run = ModelConfig(**LLAMA_LIKE, **setting)
        check_same_model(manifest, run, "the checkpoint")  # raises on a difference
        check_config(manifest, {"model": model_shape_config(run)})  # what resume compares
