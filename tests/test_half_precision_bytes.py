"""Half precision stays half (CPU, bf16 autocast): the dtypes the attention kernels receive, the bytes each
collective moves and the bytes a layer keeps for backward.

One Qwen3-style TransformerLayer (rmsnorm, rotary, qk_norm, swiglu, GQA: h 48, nh 4, nkv 2, d 12, ffn 128) on
s 16, b 2, its float32 input and weights, forward and backward under torch.autocast("cpu", bfloat16). A bf16
[s, b, h] is 1,536 elements x 2 bytes = 3,072 bytes. Before the autocast dtype was kept (measured on the code
before this test, in parentheses):
- q and k left the head norm in float32 (bf16 x its float32 weight): the kernels received float32 q, k and bf16 v
  (on CUDA the ring then ran its math path, packed documents the per-document loop);
- tp 2: the two column dgrad all-reduces move 2 x 3,072 bf16 bytes (float32: 12,288);
- tp 2 with SP: forward all-gathers 2 x 1,536 (6,144 float32), backward re-gathers 2 x 1,536 (6,144 float32) and
  reduce-scatters dX 2 x 3,072 (12,288 float32); the row linears' traffic was already bf16;
- cp 2 ring: k/v travel in bf16, 1,536 bytes per exchange (3,072 float32); dK/dV travel in float32, the
  accumulation dtype of the ring's log-sum-exp merge and of its gradient sums (6,144, unchanged);
- one layer at p = 1 keeps 67,328 bytes (74,240): its float32 part halves, 27,648 -> 13,824 (the linears' saved
  inputs 2 x 6,144 -> 2 x 3,072 bf16, rotary's cos/sin 1,536 -> 768); what stays float32 is the norms' saved
  normalised residual stream (the residual is float32 under autocast) and the float32 statistics (1/rms, lse).
  The MLP's activations, 32,768 of it at this shape, were bf16 already.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from parallel_attention.check.collective_counter import count_collective_bytes
from parallel_attention.tensor_parallel.rng import manual_seed
from parallel_attention.transformer import ModelConfig
from parallel_attention.transformer.model import TransformerLayer

S, B, H = 16, 2, 48
CFG = ModelConfig(vocab_size=64, hidden_size=H, num_heads=4, num_kv_heads=2, max_seq_len=S, num_layers=1,
                  position_embedding="rotary", activation="swiglu", norm="rmsnorm", qkv_bias=False, out_bias=False,
                  mlp_bias=False, tie_embeddings=False, qk_norm=True)
BF16, F32 = torch.bfloat16, torch.float32
SH = S * B * H * 2  # bytes of a bf16 [s, b, h]


class _FlashDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """The dtypes of q, k, v at every call of the fused CPU flash operator (the ring's pairs)."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_scaled_dot_product_flash_attention_for_cpu":
            self.seen.add(tuple(t.dtype for t in args[:3]))
        return func(*args, **(kwargs or {}))


def _saved_by_dtype(run) -> Counter:
    """Bytes of the distinct storages autograd keeps while `run()` runs a forward, by dtype (parameters aside)."""
    storages: dict = {}

    def hold(t):
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = (t.dtype, storage.nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(hold, lambda t: t):
        run()
    totals = Counter()
    for dtype, nbytes in storages.values():
        totals[dtype] += nbytes
    return totals


def layer_worker(sequence_parallel: bool, cp_kind: str | None, documents: bool):
    """One layer's forward and backward under bf16 autocast: bytes moved per (op, dtype), forward and backward apart;
    the dtypes the core attention and the fused pair kernel received; the saved bytes by dtype."""
    from parallel_attention.transformer.documents import DocumentLayout

    context = dict(cp_group=dist.group.WORLD, context_parallel_kind=cp_kind) if cp_kind else {}
    manual_seed(0)
    layer = TransformerLayer(CFG, sequence_parallel, None, None, F32, 0, **context)
    received = []
    layer.attention.core_attention.register_forward_pre_hook(
        lambda module, args: received.append(tuple(t.dtype for t in args[:3])))
    rows = S // (dist.get_world_size() if sequence_parallel or cp_kind else 1)
    x = torch.randn(rows, B, H, generator=torch.Generator().manual_seed(1)).requires_grad_()
    ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * S]) if documents else None
    layout = DocumentLayout.from_ids(ids) if documents else None
    flash = _FlashDtypes()
    with flash, torch.autocast("cpu", dtype=BF16):
        with count_collective_bytes() as forward:
            y = layer(x, layout)
    with flash, count_collective_bytes() as backward:
        y.float().pow(2).sum().backward()
    with torch.autocast("cpu", dtype=BF16):
        saved = _saved_by_dtype(lambda: layer(x, layout))
    return {"forward": dict(forward), "backward": dict(backward), "received": set(received),
            "flash": flash.seen, "saved": dict(saved), "output": y.dtype, "grad": x.grad.dtype}


def _check_dtypes(got):
    assert got["received"] == {(BF16, BF16, BF16)}, got["received"]  # q, k, v as the core attention gets them
    assert got["output"] == F32 and got["grad"] == F32  # the residual stream stays float32


def test_one_process_keeps_half_the_float32_bytes_and_the_kernels_get_bf16():
    (got,) = run_distributed(layer_worker, 1, 1, False, None, False)
    _check_dtypes(got)
    assert got["forward"] == got["backward"] == {}
    # float32 left: the two norms' normalised residual [s, b, h] and their 1/rms [s, b], the head norms' 1/rms
    # [s, b, heads] (4 + 2 heads), the core's lse [b, nh, s]
    assert got["saved"][F32] == 2 * (S * B * H * 4) + 2 * (S * B * 4) + S * B * 6 * 4 + B * 4 * S * 4 == 13_824
    assert got["saved"] == {F32: 13_824, BF16: 53_504}, got["saved"]


@pytest.mark.parametrize("documents", [False, True])
def test_packed_documents_reach_the_kernel_in_bf16(documents):
    (got,) = run_distributed(layer_worker, 1, 1, False, None, documents)
    _check_dtypes(got)


def test_tensor_parallel_moves_bf16():
    got = run_distributed(layer_worker, 2, 2, False, None, False)
    for rank in got:
        _check_dtypes(rank)
        assert rank["forward"] == {("all_reduce", BF16): 2 * SH}, rank["forward"]  # dense, fc_out outputs
        assert rank["backward"] == {("all_reduce", BF16): 2 * SH}, rank["backward"]  # qkv, fc_in dX (was 4 SH)


def test_sequence_parallel_moves_bf16():
    got = run_distributed(layer_worker, 2, 2, True, None, False)
    for rank in got:
        _check_dtypes(rank)
        # forward: the columns gather their [s/2, b, h] input chunk, the rows reduce-scatter their [s, b, h] output
        assert rank["forward"] == {("all_gather_into_tensor", BF16): SH, ("reduce_scatter_tensor", BF16): 2 * SH}
        # backward: the columns gather their input again, the rows gather dY; the columns reduce-scatter dX
        assert rank["backward"] == {("all_gather_into_tensor", BF16): 2 * SH, ("reduce_scatter_tensor", BF16): 2 * SH}


@pytest.mark.parametrize("documents", [False, True])
def test_the_ring_moves_bf16_kv_and_merges_in_float32(documents):
    got = run_distributed(layer_worker, 2, 1, False, "ring", documents)
    kv = 2 * B * 2 * (S // 2) * 12 * 2  # k and v stacked: [2, b, nkv, 2m, d] bf16, this rank's part
    for rank in got:
        _check_dtypes(rank)
        assert rank["flash"] == {(BF16, BF16, BF16)}, rank["flash"]  # every pair on the fused operator, in bf16
        assert rank["forward"] == {("isend", BF16): kv}, rank["forward"]
        # backward: k/v ahead in bf16; dK/dV of the block held, then home, in float32 (the accumulation dtype)
        assert rank["backward"] == {("isend", BF16): kv, ("isend", F32): 2 * 2 * kv}, rank["backward"]
