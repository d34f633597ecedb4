"""The 2-D recipe (docs/embedding.md): a caller's ("dp", "tp") mesh, our tensor parallelism over "tp"
(`parallelize(model, tp_group=mesh["tp"])` for a transformers model, `GPTModel(..., tp_group=mesh["tp"])` for
ours), then torch's FSDP2 `fully_shard` over "dp" on each decoder layer and on the root, trained with foreach
AdamW and `parallel_attention.clip_grad_norm_`. 4 ranks = dp 2 x tp 2, each dp rank on its half of the batch.

Against the unsharded model on the whole batch (same weights): losses within 1e-5 and clipped gradient norms
within 1e-4 over 4 steps (float32: the sharded GEMMs and the dp reduce-scatter sum the same products in another
order, ~1e-7 per op; four Adam steps amplify it a little). Both models run in one spawned world."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import parallel_attention as pa
from distributed import run_distributed
from parallel_attention.transformer.model import GPTModel
from parallel_attention.transformer.model_config import ModelConfig

STEPS, MAX_NORM, LR, VOCAB = 4, 0.05, 1e-2, 203  # MAX_NORM below the gradient norms: clipping is active
LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=8, num_kv_heads=2, activation="swiglu",
                  norm="rmsnorm", position_embedding="rotary", tie_embeddings=False, qkv_bias=False, out_bias=False,
                  mlp_bias=False, ffn_hidden_size=40, max_seq_len=16)


def _train(model, loss_of, ids: torch.Tensor, dp_group=None) -> tuple[list[float], list[float]]:
    """STEPS foreach-AdamW steps clipped by the global norm; the loss averaged over `dp_group` (its ranks' halves
    hold the same token counts, so their mean is the whole batch's)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, ids)
        loss.backward()
        pa.finalize_grads(model)  # GPTModel's partial gradients (a parallelized transformers model has none left)
        norms.append(float(pa.clip_grad_norm_(model, MAX_NORM)))
        mean = loss.detach().clone()
        if dp_group is not None:
            dist.all_reduce(mean, group=dp_group)
            mean /= dist.get_world_size(dp_group)
        losses.append(mean.item())
        opt.step()
    return losses, norms


def _shard_2d(model, layers, mesh):
    for layer in layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _gpt_loss(model, ids):
    return model(ids[:, :-1], ids[:, 1:])


def _hf_loss(model, ids):
    return model(ids, labels=ids).loss


def _recipe_worker(families: list[str]) -> dict:
    """Launched with tp = 1 (the reference's default group); the recipe brings its own ("dp", "tp") mesh."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))
    mine = ids[2 * mesh["dp"].get_local_rank():][:2]  # this dp rank's half of the batch
    results = {}
    if "gpt" in families:
        pa.manual_seed(42)
        reference = _train(GPTModel(ModelConfig(**LLAMA_LIKE)), _gpt_loss, ids)
        pa.manual_seed(42)  # rank-invariant initialisation: the tp = 2 model is a slice of the reference
        model = GPTModel(ModelConfig(**LLAMA_LIKE), tp_group=mesh["tp"])
        model = _shard_2d(model, model.layers, mesh)
        results["gpt"] = reference, _train(model, _gpt_loss, mine, mesh["dp"].get_group())
    for name in (f for f in families if f != "gpt"):
        from hf_fixtures import build

        reference = build(name)
        model = pa.parallelize(copy.deepcopy(reference), tp_group=mesh["tp"])
        model = _shard_2d(model, model.model.layers, mesh)
        results[name] = _train(reference, _hf_loss, ids), _train(model, _hf_loss, mine, mesh["dp"].get_group())
    return results


def _check(per_rank: list[dict]) -> None:
    for name, ((ref_losses, ref_norms), (losses, norms)) in per_rank[0].items():
        assert all(r[name][1] == (losses, norms) for r in per_rank), f"{name}: ranks disagree"
        assert losses == pytest.approx(ref_losses, rel=1e-5), name
        assert norms == pytest.approx(ref_norms, rel=1e-4), name
        assert all(n > MAX_NORM for n in ref_norms), name  # every step clipped


def test_2d_fsdp2_over_our_tensor_parallelism_trains_like_the_unsharded_model_gpt_and_llama():
    _check(run_distributed(_recipe_worker, 4, 1, ["gpt", "llama_gqa"]))
