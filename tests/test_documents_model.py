"""GPTModel with document_ids: the loss of a packed batch equals the token mean of transformers' losses on each
document run alone (LlamaForCausalLM, tiny, same weights through parallel_attention.hf) at tp 1 and tp 2, with
and without SP; learned positions restart too (GPT-2 style, against the model on each document alone)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the reference is transformers' LlamaForCausalLM")

import parallel_attention as pa  # noqa: E402
from distributed import run_distributed  # noqa: E402
from parallel_attention import GPTModel, ModelConfig, hf_to_canonical  # noqa: E402
from parallel_attention.transformer.documents import mask_cross_document_labels  # noqa: E402

VOCAB = 97
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=64,
             rms_norm_eps=1e-5)
LENGTHS = [[5, 1, 9, 1], [2, 13, 1]]  # odd lengths and single-token documents; s = 16 (even: SP at tp 2)


def _batch():
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g)
    ids = torch.stack([torch.cat([torch.full((n,), 2 * i + r) for i, n in enumerate(row)])
                       for r, row in enumerate(LENGTHS)])
    labels = torch.cat([tokens[:, 1:], torch.zeros(2, 1, dtype=torch.long)], dim=1)
    next_ids = torch.cat([ids[:, 1:], torch.full((2, 1), -1)], dim=1)  # the last label is no one's
    return tokens, ids, mask_cross_document_labels(labels, next_ids, ids, -100)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(the transformers model's token-mean loss over each document alone, its canonical import)."""
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    model.save_pretrained(path)
    tokens, ids, _ = _batch()
    total, count = 0.0, 0
    with torch.no_grad():
        for r in range(2):
            for doc in ids[r].unique():
                piece = tokens[r][ids[r] == doc].unsqueeze(0)
                if piece.shape[1] > 1:  # a single token predicts nothing
                    total += model(piece, labels=piece).loss.item() * (piece.shape[1] - 1)
                    count += piece.shape[1] - 1
    return total / count, hf_to_canonical(path)


def _packed_loss(cfg: ModelConfig, canonical: dict, sequence_parallel: bool) -> tuple[float, float]:
    """(the packed batch's loss with document_ids, without them) on this rank's tensor-parallel group."""
    model = GPTModel(cfg, sequence_parallel=sequence_parallel).eval()
    model.load_canonical_state_dict(canonical)
    tokens, ids, labels = _batch()
    with torch.no_grad():
        return model(tokens, labels, document_ids=ids).item(), model(tokens, labels).item()


@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True)])
def test_packed_loss_is_the_token_mean_of_transformers_losses_per_document(llama, tp, sequence_parallel):
    reference, (cfg, canonical) = llama
    per_rank = run_distributed(_packed_loss, tp, tp, cfg, canonical, sequence_parallel)
    for packed, unmasked in per_rank:
        # float32 against float32, same weights: summation orders differ (~1e-7 relative); crossing a document
        # or a position not restarted moves the loss by ~1e-2
        assert packed == pytest.approx(reference, abs=1e-5)
        assert abs(unmasked - reference) > 1e-3  # without document_ids the batch is one long document


def test_learned_positions_restart_in_each_document():
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=24, num_layers=2, num_heads=4, max_seq_len=32,
                      position_embedding="learned")
    torch.manual_seed(1)
    model = GPTModel(cfg).eval()
    tokens, ids, labels = _batch()
    total, count = 0.0, 0
    with torch.no_grad():
        packed = model(tokens, labels, document_ids=ids).item()
        for r in range(2):
            for doc in ids[r].unique():
                piece = tokens[r][ids[r] == doc].unsqueeze(0)
                if piece.shape[1] > 1:
                    n = piece.shape[1] - 1
                    total += model(piece[:, :-1], piece[:, 1:]).item() * n
                    count += n
    assert packed == pytest.approx(total / count, abs=1e-5)


def test_document_ids_of_another_shape_are_refused():
    model = GPTModel(ModelConfig(vocab_size=VOCAB, hidden_size=24, num_layers=1, num_heads=4, max_seq_len=32))
    tokens, ids, _ = _batch()
    with pytest.raises(ValueError, match=r"document_ids must be \[b, s\] = \[2, 16\], the tokens' shape"):
        model(tokens, document_ids=ids[:, :8])
    assert pa.GPTModel is GPTModel
