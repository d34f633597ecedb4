"""parallelize's loss (hf/tp_loss.py): transformers' ForCausalLMLoss computed on this rank's vocabulary columns.
Against the unsharded transformers model with the same weights at p = 2 (vocabulary 301: rank 1 holds a padding
column): the loss within 1e-6 relative (float32) with ignored labels, with num_items_in_batch and with
shift_labels, every gradient equal (norm within 1e-5 relative); a second call on the same logits, or logits that
are not the head's, get transformers' own loss. Also: parallelize without initialize_model_parallel uses the whole
world, and a rope type our import refuses (yarn, dynamic) keeps transformers' own rotary embedding."""

from __future__ import annotations

import copy

import pytest
import torch

import parallel_attention as pa
from distributed import run_distributed
from hf_fixtures import VOCAB, build

tf = pytest.importorskip("transformers")


def _labels():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    labels[1, 7] = -100
    shifted = torch.randint(0, VOCAB, (2, 12), generator=g)
    shifted[1, :5] = -100
    return ids, labels, shifted


def _losses_and_norms(model, ids, labels, shifted, clip):
    cases = {"plain": {}, "num_items": {"num_items_in_batch": torch.tensor(9)}, "shift_labels": {
        "shift_labels": shifted}, "num_items_int": {"num_items_in_batch": 5, "shift_labels": shifted}}
    out = {}
    for case, kwargs in cases.items():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=labels, **kwargs).loss
        loss.backward()
        out[case] = (loss.item(), float(clip(model)))
    return out


def _loss_checks():
    reference = build("llama_gqa").train()
    model = pa.parallelize(copy.deepcopy(reference))
    ids, labels, shifted = _labels()
    expected = _losses_and_norms(reference, ids, labels, shifted,
                                 lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9))
    actual = _losses_and_norms(model, ids, labels, shifted, lambda m: pa.clip_grad_norm_(m, 1e9))
    with torch.no_grad():
        logits = model(ids).logits
        first = model.loss_function(logits, labels, VOCAB)
        again = model.loss_function(logits, labels, VOCAB)  # the columns were used: transformers' own loss
        copied = model.loss_function(logits.clone(), labels, VOCAB)
        direct = reference.loss_function(reference(ids).logits, labels, VOCAB)
    return expected, actual, [first.item(), again.item(), copied.item(), direct.item()]


def test_the_loss_is_transformers_loss_from_this_ranks_columns():
    for expected, actual, calls in run_distributed(_loss_checks, 2, 2):
        for case, (loss, norm) in expected.items():
            assert abs(actual[case][0] - loss) <= 1e-6 * abs(loss), (case, actual[case], loss)
            assert abs(actual[case][1] - norm) <= 1e-5 * norm, (case, actual[case], norm)
        assert expected["plain"][0] != expected["num_items"][0] != expected["shift_labels"][0]
        assert max(abs(c - calls[-1]) for c in calls) <= 1e-6 * abs(calls[-1]), calls


def _full_logits_losses(model, ids, labels, clip):
    """[(loss, norm)]: a loss of the caller's own on `.logits` (a z-loss), then with transformers' `.loss` added
    (the head's gradient from both: the full logits' rows of this rank and its own columns')."""
    out = []
    for add_loss in (False, True):
        model.zero_grad(set_to_none=True)
        output = model(ids, labels=labels)
        total = output.logits.logsumexp(-1).pow(2).mean() + (output.loss if add_loss else 0.0)
        total.backward()
        out.append((total.item(), float(clip(model))))
    return out


def _full_logits_checks():
    reference = build("llama_gqa").train()
    model = pa.parallelize(copy.deepcopy(reference))
    ids, labels, _ = _labels()
    return (_full_logits_losses(reference, ids, labels, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)),
            _full_logits_losses(model, ids, labels, lambda m: pa.clip_grad_norm_(m, 1e9)))


def test_a_loss_on_the_full_logits_gets_the_unsharded_gradients():
    for expected, actual in run_distributed(_full_logits_checks, 2, 2):
        for (loss, norm), (loss_p, norm_p) in zip(expected, actual, strict=True):
            assert abs(loss_p - loss) <= 1e-6 * abs(loss) and abs(norm_p - norm) <= 1e-5 * norm, (expected, actual)
        assert expected[0][1] != expected[1][1]


def _one_step(seq: int, seed: int):
    """(losses, gradient norms) of one step of llama3_rope unsharded and parallelized, and the parallelized model."""
    reference = build("llama3_rope").train()
    model = pa.parallelize(copy.deepcopy(reference))
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seed))
    losses = [m(ids, labels=ids).loss for m in (reference, model)]
    for loss in losses:
        loss.backward()
    norms = (float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)), float(pa.clip_grad_norm_(model, 1e9)))
    return [loss.item() for loss in losses], norms, model


def _world_without_model_parallel():
    """A world where initialize_model_parallel was never called (as under torchrun with only init_process_group)."""
    pa.destroy_model_parallel()
    losses, norms, model = _one_step(8, 6)
    return abs(losses[0] - losses[1]), norms, model.lm_head.tp_size


def test_parallelize_without_initialize_model_parallel_uses_the_world():
    for loss_error, (expected, actual), tp_size in run_distributed(_world_without_model_parallel, 2, 2, fresh=True):
        assert tp_size == 2 and loss_error <= 1e-5
        assert abs(actual - expected) <= 1e-5 * expected


_ROPES = {"yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
          "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}


def _rope_logit_errors():
    errors = {}
    for rope, parameters in _ROPES.items():
        config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=72, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                rope_parameters=parameters)
        torch.manual_seed(0)
        reference = tf.LlamaForCausalLM(config).eval()
        model = pa.parallelize(copy.deepcopy(reference))
        ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(7))  # past 16 positions
        with torch.no_grad():
            errors[rope] = (model(ids).logits - reference(ids).logits).abs().max().item()
    return errors


def test_a_rope_type_the_import_refuses_keeps_transformers_rotary():
    for errors in run_distributed(_rope_logit_errors, 2, 2):
        assert set(errors) == {"yarn", "dynamic"} and max(errors.values()) <= 1e-5, errors


def _chunked_attention_step():
    """Training without padding at s 160 (the chunked kernel's range): loss and gradient norm of the unsharded model,
    through the chunked kernel in every layer (counted)."""
    from parallel_attention.transformer.kernels import causal_chunks

    calls = []
    kernel = causal_chunks.chunked_causal_attention
    causal_chunks.chunked_causal_attention = lambda *a: calls.append(1) or kernel(*a)
    try:
        losses, norms, _ = _one_step(160, 8)
    finally:
        causal_chunks.chunked_causal_attention = kernel
    return losses, norms, len(calls)


def test_training_without_padding_takes_the_chunked_kernel_with_the_same_result():
    for (expected, actual), (norm, tp_norm), calls in run_distributed(_chunked_attention_step, 2, 2):
        assert calls == 2  # both layers
        assert abs(actual - expected) <= 1e-6 * abs(expected) and abs(tp_norm - norm) <= 1e-5 * norm
