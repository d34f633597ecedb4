"""parallelize + FSDP2 on a caller's ("dp", "tp") mesh: parallelize(model, tp_group=mesh["tp"]), then
fully_shard(layer, mesh=mesh["dp"]) on each decoder layer and on the root. Four clipped foreach-AdamW steps
(each dp rank on its half of the batch) give the unsharded model's losses (1e-5) and gradient norms (1e-4): the
norm sums FSDP2's local shards over dp and counts tensor-parallel replicas once (clip_grad_norm_)."""

from __future__ import annotations

import copy

import pytest
import torch

import parallel_attention as pa
from distributed import run_distributed
from hf_fixtures import VOCAB, build

pytest.importorskip("transformers")
fsdp = pytest.importorskip("torch.distributed.fsdp")

MAX_NORM = 0.05


def _losses_and_norms(model, ids, clip):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses, norms = [], []
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        norms.append(float(clip(model)))
        losses.append(loss.item())
        opt.step()
    return losses, norms


def _two_d(name: str):
    mesh = pa.get_device_mesh()
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    reference = build(name).train()
    model = pa.parallelize(copy.deepcopy(reference), tp_group=mesh["tp"])
    for layer in model.model.layers:
        fsdp.fully_shard(layer, mesh=mesh["dp"])
    fsdp.fully_shard(model, mesh=mesh["dp"])
    ids = torch.randint(0, VOCAB, (2 * dp, 10), generator=torch.Generator().manual_seed(5))
    ref_losses, ref_norms = _losses_and_norms(reference, ids, lambda m: torch.nn.utils.clip_grad_norm_(
        m.parameters(), MAX_NORM, foreach=True))
    mine = ids.chunk(dp)[dp_rank]  # equal token counts: the mean of the dp ranks' losses is the full batch's
    losses, norms = _losses_and_norms(model, mine, lambda m: pa.clip_grad_norm_(m, MAX_NORM))
    mean_losses = [float(pa.tensor_parallel.collectives.all_reduce(torch.tensor(x), mesh["dp"].get_group())) / dp
                   for x in losses]
    return ref_losses, ref_norms, mean_losses, norms


@pytest.mark.parametrize("name", ["llama3_rope", pytest.param("mqa_tied_bias", marks=pytest.mark.slow)])
def test_fsdp2_over_dp_with_parallelize_over_tp_matches_one_process(name):
    """dp = 2 x p = 2; llama3_rope has nkv 2 = p (no replicas); mqa_tied_bias would add the k/v replica rows
    inside FSDP2's dim-0 shards and the tied head (slow variant)."""
    for ref_losses, ref_norms, losses, norms in run_distributed(_two_d, 4, 2, name, timeout=600):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)
        assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) <= 1e-4, (norms, ref_norms)
        assert min(ref_norms) > MAX_NORM
