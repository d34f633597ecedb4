"""parallelize's contract beyond equivalence: the exact collectives of a training step, what it refuses (by name),
p = 1 without torch.distributed, and that finalize_grads has nothing left to do (gradients complete in backward)."""

from __future__ import annotations

import copy

import pytest
import torch

import parallel_attention as pa
from parallel_attention.check.collective_counter import count_collectives
from distributed import run_distributed
from hf_fixtures import VOCAB, build

tf = pytest.importorskip("transformers")


def _step_counts(name: str):
    model = pa.parallelize(build(name).train())
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    with count_collectives() as forward:
        loss = model(ids, labels=ids).loss
    with count_collectives() as backward:
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with count_collectives() as finalize:
        pa.finalize_grads(model)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    return dict(forward), dict(backward), dict(finalize)


def _counts_of(names):
    return {name: _step_counts(name) for name in names}


@pytest.mark.parametrize("p", [2, 4])
def test_a_training_step_issues_the_documented_collectives(p):
    """2 layers. Forward: the embedding's all-reduce, 2 per layer (attention and MLP outputs), the logits'
    all-gather, the loss's 2 (the vocab-parallel cross entropy's max and sums). Backward: 2 per layer (the dX of the fused QKV and gate/up GEMMs), the head's dX; one more per
    layer for k/v replicas (llama3_rope: nkv 2 < p = 4) and for Qwen3's q/k norms. finalize_grads: none."""
    counts = run_distributed(_counts_of, p, p, ["llama_gqa", "llama3_rope", "qwen3"])[0]
    replicas = 2 if p > 2 else 0
    assert counts["llama_gqa"] == ({"all_reduce": 7, "all_gather_into_tensor": 1}, {"all_reduce": 5}, {})
    assert counts["llama3_rope"] == ({"all_reduce": 7, "all_gather_into_tensor": 1}, {"all_reduce": 5 + replicas},
                                     {})
    assert counts["qwen3"] == ({"all_reduce": 7, "all_gather_into_tensor": 1}, {"all_reduce": 7 + replicas}, {})


def _refusal_messages():
    p = pa.get_tensor_model_parallel_world_size()
    llama = dict(vocab_size=VOCAB, intermediate_size=72, num_hidden_layers=1)
    cases = {
        "architecture": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)),
        "heads": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**llama, num_attention_heads=2 * p - 1,
                                                            num_key_value_heads=1, hidden_size=16 * (2 * p - 1))),
        "kv_heads": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**llama, num_attention_heads=12,
                                                               num_key_value_heads=3, hidden_size=96)),
        "cross_attention": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1,
                                                                    n_head=2, add_cross_attention=True)),
        "twice": lambda: pa.parallelize(build("llama_gqa")),
    }
    messages = {}
    for case, make in cases.items():
        with pytest.raises(ValueError) as error:
            pa.parallelize(make())
        messages[case] = str(error.value)
    with pytest.raises(ValueError) as error:
        pa.hf.save_pretrained(build("gpt2"), "unused")
    messages["save_unparallelized"] = str(error.value)
    return messages


def test_refusals_name_the_value_and_the_supported_list():
    messages = run_distributed(_refusal_messages, 2, 2)[0]
    assert "GPTNeoXForCausalLM" in messages["architecture"] and "Qwen3ForCausalLM" in messages["architecture"]
    assert "num_attention_heads=3" in messages["heads"]
    assert "num_key_value_heads=3" in messages["kv_heads"]
    assert "add_cross_attention" in messages["cross_attention"]
    assert "already tensor parallel" in messages["twice"]
    assert "parallelize(model) first" in messages["save_unparallelized"]


def _world_default_logits_error():
    """Without initialize_model_parallel, tp_group=None is the whole world."""
    pa.destroy_model_parallel()
    reference = build("gpt2")
    model = pa.parallelize(copy.deepcopy(reference))
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        error = (model(ids).logits - reference(ids).logits).abs().max().item()
    return error, model.lm_head.tp_size


def test_without_model_parallel_groups_the_default_is_the_world():
    for error, tp_size in run_distributed(_world_default_logits_error, 2, 2):
        assert error <= 1e-5 and tp_size == 2


def test_p1_without_torch_distributed_is_transformers_itself():
    """No process group at all: the same pieces at p = 1 (no collective), the same logits and gradients."""
    reference = build("qwen3")
    model = pa.parallelize(copy.deepcopy(reference))
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    for m in (reference, model):
        m(ids, labels=ids).loss.backward()
    assert (model(ids).logits - reference(ids).logits).abs().max() <= 1e-5
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    assert abs(float(pa.clip_grad_norm_(model, 1.0)) - float(expected)) <= 1e-5 * float(expected)


def test_a_transformers_version_outside_the_tested_range_is_named():
    from parallel_attention.hf import transformers_api

    with pytest.raises(ImportError, match=r"transformers>=5.0,<6, but 4.45.0 is installed"):
        transformers_api.check_version("4.45.0")
    transformers_api.check_version(tf.__version__)  # the installed one is in range
