"""Labels and token ids as they enter the model: -100 is left out of the loss exactly as
F.cross_entropy(ignore_index=-100) does, and any other id outside the vocabulary is refused by
name, at every p."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import parallel_attention as pa
from distributed import run_distributed
from parallel_attention import GPTModel, ModelConfig

SPEC = dict(vocab_size=203, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=16)


def _worker():
    pa.manual_seed(1)
    model = GPTModel(ModelConfig(**SPEC))
    torch.manual_seed(2)
    tokens = torch.randint(0, 203, (3, 10))
    labels = torch.randint(0, 203, (3, 10))
    labels[0, :4] = -100
    labels[2, 7:] = -100
    loss = model(tokens, labels)
    loss.backward()
    with torch.no_grad():  # full logits: every rank's vocabulary slice, gathered
        logits = pa.gather_from_tensor_parallel_region(model(tokens), model.tp_group)[..., :203]
    reference = F.cross_entropy(logits.transpose(0, 1).reshape(-1, 203).double(), labels.reshape(-1),
                                ignore_index=-100)
    errors = {}
    for name, bad_tokens, bad_labels in (("label", tokens, labels.clone().fill_(203)),
                                         ("negative label", tokens, labels.clone().fill_(-1)),
                                         ("token", tokens.clone().fill_(250), labels)):
        with pytest.raises(ValueError) as info:
            model(bad_tokens, bad_labels)
        errors[name] = str(info.value)
    return loss.item(), reference.item(), errors


@pytest.mark.parametrize("world_size", [1, 2])
def test_ignored_labels_and_out_of_range_ids(world_size):
    for loss, reference, errors in run_distributed(_worker, world_size, world_size):
        # float32 model against a float64 cross entropy of the same logits
        assert loss == pytest.approx(reference, rel=1e-5)
        assert "label id 203" in errors["label"] and "[0, 203)" in errors["label"]
        assert "label id -1" in errors["negative label"]
        assert "token id 250" in errors["token"]
