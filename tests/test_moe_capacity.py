"""Mixture of experts, capacity mode and counted tokens: the slots each expert keeps are its first in the global token
order (a reference written here), the layer with drops matches the reference loop of test_moe, tokens whose label
is ignored leave the auxiliary losses as if they were not there, and both hold at tp 2 (with and without SP), cp 2
(all-to-all and ring), pp 2 (the stage without the loss) and ep 2 like one process: the same dropped slots, losses
and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from parallel_attention.tensor_parallel.collectives import all_reduce
from parallel_attention.transformer.context_parallel import held_positions
from parallel_attention.transformer.model import GPTModel
from parallel_attention.transformer.moe import MoELayer, moe_step
from parallel_attention.transformer.moe.capacity import TokenCapacity
from tests.distributed import run_distributed
from tests.test_moe import E, H, K, _canonical, moe_config, reference_moe

S, B = 16, 2  # the model tests' micro-batch: 16 positions (cp 2 x 2 zigzag chunks x tp 2 divides it), 2 rows


def expected_kept(expert_ids: torch.Tensor, capacity: int) -> torch.Tensor:
    """[s, b, k] bool: an expert keeps its first `capacity` slots, positions first, then rows (written plainly)."""
    s, b, k = expert_ids.shape
    taken, kept = [0] * E, torch.zeros(s, b, k, dtype=torch.bool)
    for position in range(s):
        for row in range(b):
            for choice in range(k):
                e = int(expert_ids[position, row, choice])
                kept[position, row, choice] = taken[e] < capacity
                taken[e] += 1
    return kept


def test_capacity_keeps_each_experts_first_slots_in_token_order():
    torch.manual_seed(0)
    s, b = 5, 3
    expert_ids = torch.stack([torch.randperm(E)[:K] for _ in range(s * b)])  # k distinct experts per token
    expert_ids[:6, 0] = 1  # expert 1 over-subscribed
    capacity = TokenCapacity(0.5, E, (), None)
    slots = capacity(expert_ids, s)
    assert capacity.capacity(s * b, K) == math.ceil(0.5 * s * b * K / E) == 3
    kept = expected_kept(expert_ids.view(s, b, K), 3).reshape(-1)
    assert torch.equal(slots.experts, torch.where(kept, expert_ids.reshape(-1), E))
    assert slots.kept == int(kept.sum()) < s * b * K
    assert slots.dropped.item() == pytest.approx(1 - kept.float().mean().item())
    with pytest.raises(ValueError, match="moe_capacity_factor=0 must be > 0"):
        TokenCapacity(0, E, (), None)


def test_a_dropped_slot_adds_nothing_and_the_layer_matches_the_reference():
    """float64 (the experts' loop): the output, every gradient and the auxiliary losses of a layer whose experts
    drop slots past capacity 0.5, against test_moe's token-by-token reference with the same capacity; in eval mode
    the dropless reference's output."""
    cfg = moe_config(moe_capacity_factor=0.5)
    torch.manual_seed(0)
    layer = MoELayer(cfg, dtype=torch.float64)
    x = torch.randn(10, 1, H, dtype=torch.float64, requires_grad=True)
    with moe_step(0.5) as record:
        (layer(x) * x.detach()).sum().backward()
    sd = {k: v.detach().requires_grad_() for k, v in _canonical(layer).items()}
    x_ref = x.detach().reshape(10, H).requires_grad_()
    y_ref, aux_ref = reference_moe(sd, x_ref, cfg)
    ((y_ref * x_ref.detach()).sum() + 0.5 * aux_ref).backward()
    torch.testing.assert_close(x.grad.reshape(10, H), x_ref.grad)
    for name, grad in _canonical(layer, grad=True).items():
        torch.testing.assert_close(grad, sd[name].grad, msg=name)
    aux, z, _, dropped = record.rows[0][0][:4]
    torch.testing.assert_close(aux + z, aux_ref.detach())
    assert dropped > 0
    with torch.no_grad():  # evaluation and generation run dropless; training drops again
        torch.testing.assert_close(layer.eval()(x).reshape(10, H), reference_moe(sd, x_ref, moe_config())[0])
        torch.testing.assert_close(layer.train()(x).reshape(10, H), y_ref)


def _batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, labels [B, S] with about a third of the labels ignored, in the middle of rows too."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (B, S), generator=gen)
    labels = torch.randint(0, 64, (B, S), generator=gen)
    return tokens, labels.masked_fill(torch.rand(B, S, generator=gen) < 0.35, -100)


def _model_step(model: GPTModel, tokens, labels) -> tuple[float, dict]:
    with moe_step(1.0) as record:
        loss = model(tokens, labels)
        loss.backward()
    return loss.item(), record


@pytest.mark.parametrize("recompute", [False, True])
def test_ignored_labels_leave_the_aux_losses_as_without_those_tokens(recompute):
    """A causal model: the tokens after the last counted one of each row change nothing before them, so the batch
    with their labels ignored (a row all ignored, another's tail) gives the loss, the auxiliary losses and every
    gradient of the batch without them. Recomputed layers count the same tokens (counted_tokens.replaying)."""
    cfg = moe_config(recompute_activations=recompute)
    tokens, labels = _batch()
    labels[1] = -100
    labels[0, 11:] = -100
    results = []
    for t, l in ((tokens, labels), (tokens[:1, :11], labels[:1, :11])):
        torch.manual_seed(0)
        model = GPTModel(cfg)
        loss, record = _model_step(model, t, l)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss, record.metrics(cfg), grads))
    (loss, metrics, grads), (loss_ref, metrics_ref, grads_ref) = results
    assert loss == pytest.approx(loss_ref, rel=1e-6)
    for key in ("moe_aux_loss/0", "moe_aux_loss/1", "moe_z_loss/0", "moe_z_loss/1"):
        assert metrics[key] == pytest.approx(metrics_ref[key], rel=1e-6), key
    for name, grad in grads_ref.items():  # float32: the same products, summed over other shapes
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    torch.manual_seed(0)
    _, every_token = _model_step(GPTModel(cfg), tokens, labels.clamp(min=0))  # the same batch, nothing ignored
    assert every_token.metrics(cfg)["moe_aux_loss/0"] != pytest.approx(metrics["moe_aux_loss/0"], rel=1e-6)


class _RecordedSlots:
    """A layer's capacity, keeping each call's slots [rows, b, k] with the global positions of their rows."""

    def __init__(self, capacity: TokenCapacity) -> None:
        self.capacity, self.calls = capacity, []

    def __call__(self, expert_ids: torch.Tensor, rows: int):
        slots = self.capacity(expert_ids, rows)
        c = self.capacity
        self.calls.append((slots.experts.view(rows, -1, K), held_positions(rows, c.cp_group, c.pieces, c.piece)))
        return slots


def _recorded(model: GPTModel) -> dict[int, _RecordedSlots]:
    recorders = {}
    for i, layer in zip(model.layers.global_indices(), model.layers):
        layer.mlp.capacity = recorders[i] = _RecordedSlots(layer.mlp.capacity)
    return recorders


CAPACITY = dict(moe_capacity_factor=0.5, moe_shared_expert_ffn_hidden_size=8, moe_shared_expert_gate=True)


def _layout_worker(layout: str) -> dict:
    """This rank's loss, layer metrics, slots and router gradients (completed as DDP and finalize_grads would)."""
    import parallel_attention as pa
    from parallel_attention.pipeline.after_schedule import losses_on_every_stage
    from parallel_attention.pipeline.layout import rank_stage
    from parallel_attention.pipeline.micro_batch_step import MicroBatchStep
    from parallel_attention.pipeline.runner import PipelineRunner
    from parallel_attention.tensor_parallel import finalize_grads, parallel_state as ps

    pa.destroy_model_parallel()
    tp, cp, pp = {"tp2_sp": (2, 1, 1), "tp2": (2, 1, 1), "cp2": (1, 2, 1), "cp2_ring": (1, 2, 1),
                  "pp2": (1, 1, 2)}[layout]
    pa.initialize_model_parallel(tp, context_parallel_size=cp, pipeline_model_parallel_size=pp)
    cfg = moe_config(**CAPACITY)
    torch.manual_seed(0)
    stage = rank_stage(cfg.num_layers, 2, 1, None, ps.get_pipeline_parallel_rank()) if pp > 1 else None
    kind = "ring" if "ring" in layout else "all_to_all"
    model = GPTModel(cfg, sequence_parallel=layout == "tp2_sp", context_parallel_kind=kind,
                     **({"stage": stage} if stage else {}))
    recorders = _recorded(model)
    tokens, labels = _batch()
    with moe_step(1.0) as record:
        if pp > 1:
            runner = PipelineRunner(model, "1f1b", 1, ps.get_pipeline_parallel_group(), ps.get_pipeline_links(), 1)
            runner.agree_shapes((S, B, H), torch.float32)
            loss = losses_on_every_stage(runner.run(MicroBatchStep(model, [(tokens, labels)])),
                                         ps.get_pipeline_parallel_group())
        else:
            loss = model(tokens, labels)
            loss.backward()
    finalize_grads(model)
    routers = {i: all_reduce(layer.mlp.gate.weight.grad, ps.get_context_parallel_group()) / cp
               for i, layer in zip(model.layers.global_indices(), model.layers)}  # DDP's average over cp
    slots = {i: r.calls for i, r in recorders.items()}
    return {"loss": loss.sum().item(), "metrics": record.metrics(cfg, None, ps.get_pipeline_parallel_group()),
            "slots": slots, "routers": routers}


@pytest.mark.parametrize("layout,world", [("tp2_sp", 2), ("tp2", 2), ("cp2", 2), ("cp2_ring", 2), ("pp2", 2)])
def test_dropped_slots_and_counted_tokens_are_one_process_s_at_every_layout(layout, world):
    """Capacity 0.5 (every layer drops slots) and a third of the labels ignored: each rank drops exactly the one
    process's slots at its positions (capacity over the whole micro-batch, in its global order), and the loss, the
    auxiliary losses over the counted tokens, the dropped shares and the router's gradients are one process's."""
    ranks = run_distributed(_layout_worker, world, 1, layout)
    cfg = moe_config(**CAPACITY)
    torch.manual_seed(0)
    model = GPTModel(cfg)
    reference = _recorded(model)
    loss, record = _model_step(model, *_batch())
    metrics = record.metrics(cfg)
    assert all(metrics[f"moe_dropped/{i}"] > 0 for i in (0, 1))
    for got in ranks:
        assert got["loss"] == pytest.approx(loss, rel=1e-5)
        for key, value in metrics.items():  # float32: sums over the ranks' parts in other orders
            assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        for i, calls in got["slots"].items():
            (full, _), = reference[i].calls
            for slots, positions in calls:  # the rank's slots: the one process's at its positions
                assert torch.equal(slots, full[positions]), (layout, i)
            torch.testing.assert_close(got["routers"][i], model.layers[i].mlp.gate.weight.grad, rtol=1e-5, atol=1e-7)


def _expert_parallel_worker() -> tuple:
    """dp 2 = ep 2, each rank its own micro-batch [S, B]: its output and slots."""
    import parallel_attention as pa

    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1, expert_model_parallel_size=2)
    torch.manual_seed(0)
    layer = MoELayer(moe_config(**CAPACITY))
    recorder = layer.capacity = _RecordedSlots(layer.capacity)
    x = torch.randn(2, S, B, H, generator=torch.Generator().manual_seed(5))[torch.distributed.get_rank()]
    with moe_step(1.0) as record:
        y = layer(x)
    return y.detach(), recorder.calls[0][0], record.rows[0][0]


def test_expert_parallel_drops_each_micro_batch_s_own_slots():
    """ep 2 over dp 2: each rank's micro-batch has its own capacity, so its drops, output and record are one
    process's on that micro-batch (the all-to-alls only move the kept slots)."""
    ranks = run_distributed(_expert_parallel_worker, 2, 1)
    torch.manual_seed(0)
    layer = MoELayer(moe_config(**CAPACITY))
    recorder = layer.capacity = _RecordedSlots(layer.capacity)
    for rank, (y, slots, row) in enumerate(ranks):
        x = torch.randn(2, S, B, H, generator=torch.Generator().manual_seed(5))[rank]
        with moe_step(1.0) as record:
            y_ref = layer(x)
        assert torch.equal(slots, recorder.calls[-1][0]) and (slots == E).any()
        torch.testing.assert_close(y, y_ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(row, record.rows[0][0], rtol=1e-5, atol=1e-7)
