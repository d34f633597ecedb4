"""Packed documents (transformer/documents.py): the layout and its checks; attention with documents against the
independent float64 reference (output, input and weight gradients; GQA, rotary, causal and not; odd lengths, a
document across a 64-row chunk boundary, single-token documents) for every kernel and recompute; layout-invariant
dropout; and that the CPU kernel computes the documents' blocks only (kernel calls counted)."""

from __future__ import annotations

import pytest
import torch

import parallel_attention as pa
from parallel_attention.tensor_parallel.rng import dropout_coordinates
from parallel_attention.transformer.kernels import causal_chunks
from parallel_attention.transformer.documents import DocumentLayout, check_document_ids
from parallel_attention.check.reference import reference_attention
from fused_rows import expected_fused_rows

# ids per row: lengths 1, 70 (across the chunk boundary at 64), 3, 1, 55, 10 in row 0; other ones in row 1
LENGTHS = [[1, 70, 3, 1, 55, 10], [130, 1, 9]]  # 130: a document chunked inside (>= 2 * CHUNK_ROWS)
S = 130 + 1 + 9


def _ids(lengths_per_row, first_id=5) -> torch.Tensor:
    rows = [torch.cat([torch.full((n,), first_id + 3 * i) for i, n in enumerate(lengths)])
            for lengths in lengths_per_row]
    return torch.stack(rows)


def _brute_mask(ids: torch.Tensor, q_index, k_index, causal: bool) -> torch.Tensor:
    b = ids.shape[0]
    out = torch.zeros(b, 1, len(q_index), len(k_index), dtype=torch.bool)
    for r in range(b):
        for i, qi in enumerate(q_index.tolist()):
            for j, kj in enumerate(k_index.tolist()):
                out[r, 0, i, j] = bool(ids[r, qi] == ids[r, kj]) and (not causal or kj <= qi)
    return out


# ------------------------------------------------------------------------------ the layout
def test_layout_holds_segments_restarted_positions_and_spans():
    layout = DocumentLayout.from_ids(torch.tensor([[7, 7, 3, 3, 3, 9], [2, 2, 2, 2, 2, 2]]))
    assert layout.segments.tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
    assert layout.positions.tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]
    assert layout.starts.tolist()[0] == [0, 0, 2, 2, 2, 5] and layout.ends.tolist()[0] == [2, 2, 5, 5, 5, 6]
    assert layout.spans(0) == ((0, 2), (2, 5), (5, 6)) and layout.spans(1) == ((0, 6),)
    assert not layout.uniform() and DocumentLayout.from_ids(torch.zeros(3, 4, dtype=torch.int32)).uniform()


@pytest.mark.parametrize("ids,shape,message", [
    (torch.zeros(2, 4), None, "integer tensor"),
    (torch.zeros(2, 4, dtype=torch.bool), None, "integer tensor"),
    (torch.zeros(8, dtype=torch.long), None, r"must be \[b, s\]"),
    (torch.zeros(2, 4, dtype=torch.long), (2, 5), r"\[2, 5\], the tokens' shape"),
    (torch.tensor([[1, 1, 2, 2], [4, 5, 4, 6]]), None, "row 1: document 4 resumes at position 2"),
])
def test_bad_document_ids_are_named(ids, shape, message):
    with pytest.raises(ValueError, match=message):
        check_document_ids(ids, shape)


@pytest.mark.parametrize("causal", [True, False])
def test_mask_and_block_pieces_match_brute_force_on_zigzag_blocks(causal):
    torch.manual_seed(3)
    ids = _ids([[3, 1, 6, 2, 4], [8, 8]])  # s 16
    layout = DocumentLayout.from_ids(ids)
    chunks = torch.arange(16).chunk(8)  # cp 4 zigzag: rank r holds chunks r and 7 - r
    blocks = [torch.cat([chunks[r], chunks[7 - r]]) for r in range(4)] + list(chunks)
    for q_index in blocks:
        for k_index in blocks:
            assert torch.equal(layout.mask(q_index, k_index, causal), _brute_mask(ids, q_index, k_index, causal))
    runs_seen = set()
    for q_chunk in chunks:  # the ring's pairs: a pair runs exactly when it has pieces
        for k_chunk in chunks:
            pieces = layout.block_pieces(int(q_chunk[0]), int(k_chunk[0]), 2, causal)
            assert bool(pieces) == bool(_brute_mask(ids, q_chunk, k_chunk, causal).any())
            runs_seen.add(bool(pieces))
    assert runs_seen == {True, False}  # both answers occur: the check is not vacuous
    full = torch.arange(16)
    assert torch.equal(layout.full_mask(causal), _brute_mask(ids, full, full, causal))


# ------------------------------------------------------------------------------ attention against the reference
CASES = {  # name: (AttentionConfig fields, ParallelSelfAttention keywords, train mode)
    "gqa_rotary_causal_auto": (dict(num_kv_heads=2, rotary=True), {}, False),
    "gqa_rotary_causal_sdpa": (dict(num_kv_heads=2, rotary=True, attention_kernel="sdpa"), {}, False),
    "mqa_rotary_causal_math": (dict(num_kv_heads=1, rotary=True, attention_kernel="math"), {}, False),
    "mha_noncausal_auto": (dict(causal=False), {}, False),
    "gqa_rotary_recompute": (dict(num_kv_heads=2, rotary=True), dict(recompute_core=True), True),
}


def _case(name, ids):
    fields, keywords, train = CASES[name]
    cfg = pa.AttentionConfig(hidden_size=32, num_heads=4, head_dim=8, params_dtype=torch.float64,
                             **{"num_kv_heads": 4, **fields})
    torch.manual_seed(11)
    module = pa.ParallelSelfAttention(cfg, **keywords).train(train)
    weights = {k: (torch.randn(v.shape, dtype=torch.float64) * 0.3).requires_grad_()
               for k, v in module.canonical_state_dict().items()}
    module.load_canonical_state_dict({k: v.detach() for k, v in weights.items()})
    return cfg, module, weights


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("rows", ["different", "uniform"])
def test_attention_with_documents_matches_the_float64_reference(name, rows):
    ids = _ids(LENGTHS) if rows == "different" else _ids([LENGTHS[0]] * 2)
    layout = DocumentLayout.from_ids(ids)
    cfg, module, weights = _case(name, ids)
    x = torch.randn(S, 2, 32, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(S, 2, 32, dtype=torch.float64)
    same_document = (ids[:, :, None] == ids[:, None, :]).unsqueeze(1)
    ref = reference_attention(x, weights, 4, cfg.num_kv_heads, 8, cfg.causal, same_document, cfg.rotary,
                              layout.positions, cfg.rope_theta)
    ref.backward(upstream)
    x_in = x.detach().clone().requires_grad_()
    out = module(x_in, documents=layout)
    out.backward(upstream)
    fused = expected_fused_rows(*(weights[f"{n}.weight"].grad for n in ("q_proj", "k_proj", "v_proj")), 0, 1, 4,
                                cfg.num_kv_heads, 8)
    # float64 on both sides: only summation orders differ (~1e-15); a document crossed gives errors of order 1
    for ours, expected in [(out, ref), (x_in.grad, x.grad), (module.query_key_value.weight.grad, fused),
                           (module.dense.weight.grad, weights["o_proj.weight"].grad)]:
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-10)


def test_a_layout_of_another_shape_is_refused():
    cfg, module, _ = _case("gqa_rotary_causal_auto", None)
    with pytest.raises(ValueError, match=r"documents describe \[b, s\] = \[2, 6\] but the attention sees \[2, 5\]"):
        module(torch.randn(5, 2, 32, dtype=torch.float64), documents=DocumentLayout.from_ids(torch.zeros(2, 6,
                                                                                                       dtype=int)))


def test_layout_invariant_dropout_sees_the_documents():
    """attention_dropout with dropout_rng='layout_invariant' in training (explicit probabilities, hashed masks):
    documents give exactly what the same-document mask and restarted positions give, and differ from neither."""
    ids = _ids(LENGTHS)
    layout = DocumentLayout.from_ids(ids)
    cfg = pa.AttentionConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, rotary=True,
                             params_dtype=torch.float64, attention_dropout=0.3, dropout_rng="layout_invariant")
    torch.manual_seed(2)
    module = pa.ParallelSelfAttention(cfg).train()
    x = torch.randn(S, 2, 32, dtype=torch.float64)
    same_document = (ids[:, :, None] == ids[:, None, :]).unsqueeze(1)
    with dropout_coordinates(seed=3, step=1, first_sample=0):
        with_documents = module(x, documents=layout)
        with_mask = module(x, same_document, layout.positions)
        plain = module(x)
    assert torch.equal(with_documents, with_mask) and not torch.allclose(with_documents, plain)


# ------------------------------------------------------------------------------ hidden blocks are skipped
def test_the_cpu_kernel_computes_only_the_documents_blocks(monkeypatch):
    """Every flash-kernel call (forward and backward) stays inside one document; the query x key products they
    compute add up to at most the documents' own squares, about half the rows' s x s."""
    calls = {"forward": [], "backward": []}
    ops = causal_chunks.CPU_FLASH_OPS  # the operator table's CPU row, which the CPU kernel runs its pieces through

    def counted_forward(q, k, v, *rest):
        calls["forward"].append((q.shape[0], q.shape[2], k.shape[2]))
        return ops.raw_forward(q, k, v, *rest)

    def counted_backward(grad, q, k, v, *rest):
        calls["backward"].append((q.shape[0], q.shape[2], k.shape[2]))
        return ops.raw_backward(grad, q, k, v, *rest)

    monkeypatch.setattr(causal_chunks, "CPU_FLASH_OPS", ops._replace(raw_forward=counted_forward,
                                                                     raw_backward=counted_backward))
    ids = _ids(LENGTHS)
    _, module, _ = _case("gqa_rotary_causal_auto", ids)
    module(torch.randn(S, 2, 32, dtype=torch.float64, requires_grad=True),
           documents=DocumentLayout.from_ids(ids)).sum().backward()
    # row 0: 6 documents under 2 * CHUNK_ROWS, one call each; row 1: 130 in chunks of 64, 64 and 2 rows, 1, 9
    assert len(calls["forward"]) == 6 + 3 + 2 == len(calls["backward"])
    assert all(rows == 1 for rows, _, _ in calls["forward"])  # rows with other documents run one by one
    products = sum(sq * sk for _, sq, sk in calls["forward"])
    squares = sum(n * n for lengths in LENGTHS for n in lengths)
    # 20666 products: 0.53 of the 2 x 140 x 140 that one unmasked call per row computes at s 140
    assert products <= squares and products < 0.55 * 2 * S * S
