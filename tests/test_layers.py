"""ColumnParallelLinear, RowParallelLinear and VocabParallelEmbedding against single-device references.

The full (unsharded) weights come from p = 1 layers built in this pytest process with the same
seeds: each rank's shard must be exactly its slice of them (weights do not depend on p). The
references are plain F.linear / F.embedding with those full weights, written here, in float64.
Sizes are awkward on purpose (in 12, out 20, vocab 20, embedding 6, s 8, b 3): a transposed or
mis-sliced dimension changes a shape or a value instead of passing by accident.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import backend_for, device_params, local_device, run_distributed
from torch import nn

import parallel_attention as pa

S, B, H, FFN, VOCAB, EMB = 8, 3, 12, 20, 20, 6
SEED_COL, SEED_ROW, SEED_EMB = 1234, 4321, 2024
F64 = torch.float64
# Sharded and reference compute the same float64 sums in a different order (per-rank partial sums,
# then a collective): rounding differs by a few ulps of values of order 1-10, far below 1e-12.
TOL = dict(rtol=1e-12, atol=1e-12)
# the linears' cases: (gather_output or input_is_parallel, bias, sequence_parallel)
COLUMN_CASES = [(False, True, False), (True, True, False), (False, False, False), (True, False, False),
                (False, True, True), (False, False, True)]
ROW_CASES = [(False, True, False), (True, True, False), (False, False, False), (True, False, False),
             (True, True, True), (True, False, True)]


def _seeded(cls, seed, *args, **kwargs):
    pa.manual_seed(seed)
    return cls(*args, dtype=F64, **kwargs)


def _full_weights_and_data(kind: str) -> tuple[dict, dict]:
    """Full weights of p = 1 layers (torch.manual_seed, no torch.distributed) and test data."""
    device = torch.device(kind)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if kind == "cuda" else []):
        full = {}
        torch.manual_seed(SEED_COL)
        full["col"] = pa.ColumnParallelLinear(H, FFN, device=device, dtype=F64).weight.detach().cpu()
        torch.manual_seed(SEED_ROW)
        full["row"] = pa.RowParallelLinear(FFN, H, device=device, dtype=F64).weight.detach().cpu()
        torch.manual_seed(SEED_EMB)
        full["emb"] = pa.VocabParallelEmbedding(VOCAB, EMB, device=device, dtype=F64).weight.detach().cpu()
    g = torch.Generator().manual_seed(7)
    data = {name: torch.randn(*shape, generator=g, dtype=F64) for name, shape in [
        ("x", (S, B, H)), ("dy_col", (S, B, FFN)), ("x_row", (S, B, FFN)), ("dy", (S, B, H)),
        ("dy_emb", (S, B, EMB)), ("b_col", (FFN,)), ("b_row", (H,))]}
    # every vocabulary id (shard edges included) at least once, some twice: grads accumulate
    data["tokens"] = torch.randperm(S * B, generator=g).remainder(VOCAB).view(S, B)
    return full, data


def _reference(fn, inputs, dy):
    """Output and gradients of a plain single-device computation."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves, dy, allow_unused=True)


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _seeded_shard(cls, seed, full_weight, split_dim, p, r, tag, *args, **kwargs):
    """A layer built from `seed` on rank r; its weight must be exactly rank r's slice of the p = 1 weight."""
    layer = _seeded(cls, seed, *args, **kwargs)
    shard = full_weight.chunk(p, split_dim)[r]
    assert torch.equal(layer.weight.detach().cpu(), shard), f"{tag}: shard is not the p=1 slice"
    return layer


def _linear_reference(X, W, b, bias, dY):
    """Output and gradients (x, w, b) of the single-device F.linear, with bias b only where `bias`."""
    return _reference(lambda x, w, bb: F.linear(x, w, bb if bias else None), [X, W, b], dY)


def _forward_backward(layer, x, dy, dev):
    """Run `layer` on a fresh leaf copy of x on `dev` and backpropagate dy: (the leaf, the output)."""
    x = x.to(dev).clone().requires_grad_()
    y = layer(x)
    y.backward(dy.to(dev))
    return x, y


def _seeded_linears(kind, cls, seed, full_weight, split_dim, p, r, sizes, option, cases, dev):
    """Rank r's shard of a linear for each case (`option`'s value, bias, sequence_parallel), built from `seed` and
    checked against the p = 1 weight: yields (value, bias, sequence_parallel, tag, layer)."""
    for value, bias, sp in cases:
        tag = f"{kind} {option}={value} bias={bias} sequence_parallel={sp}"
        yield value, bias, sp, tag, _seeded_shard(cls, seed, full_weight, split_dim, p, r, tag, *sizes, bias=bias,
                                                  sequence_parallel=sp, device=dev, **{option: value})


def _check_column(full, data, p, r, dev):
    W, b, X, dY = full["col"], data["b_col"], data["x"], data["dy_col"]
    for gather, bias, sp, tag, layer in _seeded_linears("column", pa.ColumnParallelLinear, SEED_COL, W, 0, p, r,
                                                        (H, FFN), "gather_output", COLUMN_CASES, dev):
        if bias:
            assert torch.equal(layer.bias.detach().cpu(), torch.zeros(FFN, dtype=F64).chunk(p)[r])
            layer.bias.data.copy_(b.chunk(p)[r])  # a non-zero bias, so a mis-sliced one shows
        y_ref, (gx, gw, gb) = _linear_reference(X, W, b, bias, dY)
        x, y = _forward_backward(layer, X.chunk(p, 0)[r] if sp else X, dY if gather else dY.chunk(p, -1)[r], dev)
        _close(y.detach().cpu(), y_ref if gather else y_ref.chunk(p, -1)[r], f"{tag}: output")
        _close(x.grad.cpu(), gx.chunk(p, 0)[r] if sp else gx, f"{tag}: input grad")
        _close(layer.weight.grad.cpu(), gw.chunk(p, 0)[r], f"{tag}: weight grad")
        if bias:
            _close(layer.bias.grad.cpu(), gb.chunk(p)[r], f"{tag}: bias grad")


def _check_row(full, data, p, r, dev):
    W, b, X, dY = full["row"], data["b_row"], data["x_row"], data["dy"]
    for parallel_in, bias, sp, tag, layer in _seeded_linears("row", pa.RowParallelLinear, SEED_ROW, W, 1, p, r,
                                                             (FFN, H), "input_is_parallel", ROW_CASES, dev):
        if bias:
            layer.bias.data.copy_(b)
        y_ref, (gx, gw, gb) = _linear_reference(X, W, b, bias, dY)
        x, y = _forward_backward(layer, X.chunk(p, -1)[r] if parallel_in else X, dY.chunk(p, 0)[r] if sp else dY, dev)
        if sp and bias:  # before finalize_grads each rank holds the bias grad of its own tokens only
            _close(layer.bias.grad.cpu(), dY.chunk(p, 0)[r].sum((0, 1)), f"{tag}: partial bias grad")
        pa.finalize_grads(layer)
        _close(y.detach().cpu(), y_ref.chunk(p, 0)[r] if sp else y_ref, f"{tag}: output")
        _close(x.grad.cpu(), gx.chunk(p, -1)[r] if parallel_in else gx, f"{tag}: input grad")
        _close(layer.weight.grad.cpu(), gw.chunk(p, 1)[r], f"{tag}: weight grad")
        if bias:
            _close(layer.bias.grad.cpu(), gb, f"{tag}: bias grad after finalize_grads")


def _check_embedding(full, data, p, r, dev):
    E, dY = full["emb"], data["dy_emb"]
    # all ids, then ids of shard 0 only: the other ranks then own none of the tokens
    for tokens in [data["tokens"], data["tokens"].remainder(VOCAB // p)]:
        y_ref, (gE,) = _reference(lambda e: F.embedding(tokens, e), [E], dY)
        for sp in (False, True):  # sequence parallel: this rank keeps its [s/p, b, h] chunk of the output
            emb = _seeded_shard(pa.VocabParallelEmbedding, SEED_EMB, E, 0, p, r, "embedding", VOCAB, EMB,
                                sequence_parallel=sp, device=dev)
            y = emb(tokens.to(dev))
            y.backward((dY.chunk(p, 0)[r] if sp else dY).to(dev))
            _close(y.detach().cpu(), y_ref.chunk(p, 0)[r] if sp else y_ref, f"embedding sp={sp} output")
            _close(emb.weight.grad.cpu(), gE.chunk(p, 0)[r], f"embedding sp={sp} weight grad")


def _check_mlp(full, data, p, r, dev):
    Wc, bc, Wr, br, X, dY = full["col"], data["b_col"], full["row"], data["b_row"], data["x"], data["dy"]
    y_ref, (gx, gwc, gbc, gwr, gbr) = _reference(
        lambda x, wc, bc_, wr, br_: F.linear(F.gelu(F.linear(x, wc, bc_)), wr, br_), [X, Wc, bc, Wr, br], dY)
    for sp in (False, True):
        col = _seeded(pa.ColumnParallelLinear, SEED_COL, H, FFN, sequence_parallel=sp, device=dev)
        row = _seeded(pa.RowParallelLinear, SEED_ROW, FFN, H, input_is_parallel=True, sequence_parallel=sp,
                      device=dev)
        col.bias.data.copy_(bc.chunk(p)[r])
        row.bias.data.copy_(br)
        mlp = nn.Sequential(col, nn.GELU(), row)
        x = (X.chunk(p, 0)[r] if sp else X).to(dev).clone().requires_grad_()
        y = mlp(x)
        y.backward((dY.chunk(p, 0)[r] if sp else dY).to(dev))
        pa.finalize_grads(mlp)
        tag = f"mlp sequence_parallel={sp}"
        _close(y.detach().cpu(), y_ref.chunk(p, 0)[r] if sp else y_ref, f"{tag}: output")
        _close(x.grad.cpu(), gx.chunk(p, 0)[r] if sp else gx, f"{tag}: input grad")
        _close(col.weight.grad.cpu(), gwc.chunk(p, 0)[r], f"{tag}: column weight grad")
        _close(col.bias.grad.cpu(), gbc.chunk(p)[r], f"{tag}: column bias grad")
        _close(row.weight.grad.cpu(), gwr.chunk(p, 1)[r], f"{tag}: row weight grad")
        _close(row.bias.grad.cpu(), gbr, f"{tag}: row bias grad")


def _check_bad_sizes(p, dev):
    bad = 2 * p + 1  # divisible by no p > 1
    for build in [lambda: pa.ColumnParallelLinear(H, bad), lambda: pa.RowParallelLinear(bad, H),
                  lambda: pa.VocabParallelEmbedding(bad, EMB)]:
        with pytest.raises(ValueError, match=rf"\b{bad}\b.*\b{p}\b"):
            build()
    row = pa.RowParallelLinear(FFN, H, input_is_parallel=True, sequence_parallel=True, dtype=F64, device=dev)
    with pytest.raises(ValueError, match=rf"\b{bad}\b.*\b{p}\b"):  # s % p != 0 under sequence parallelism
        row(torch.zeros(bad, B, FFN // p, dtype=F64, device=dev))


def _layers_worker(kind, full, data):
    dev = local_device(kind)
    p, r = pa.get_tensor_model_parallel_world_size(), pa.get_tensor_model_parallel_rank()
    _check_column(full, data, p, r, dev)
    _check_row(full, data, p, r, dev)
    _check_embedding(full, data, p, r, dev)
    _check_mlp(full, data, p, r, dev)
    if p > 1:
        _check_bad_sizes(p, dev)
    return p


@pytest.mark.parametrize("world_size,device", device_params())
def test_layers_match_single_device_reference(world_size, device):
    full, data = _full_weights_and_data(device)
    ranks = run_distributed(_layers_worker, world_size, world_size, device, full, data, backend=backend_for(device))
    assert ranks == [world_size] * world_size


def test_sequence_parallel_misuse_is_rejected():
    with pytest.raises(ValueError, match="gather_output"):
        pa.ColumnParallelLinear(H, FFN, gather_output=True, sequence_parallel=True)
    with pytest.raises(ValueError, match="input_is_parallel"):
        pa.RowParallelLinear(FFN, H, input_is_parallel=False, sequence_parallel=True)
