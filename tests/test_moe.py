"""Mixture of experts: the layer against a single-device reference written here, the router's tie-break, the
auxiliary losses' gradients, the balancing bias, and expert parallelism (ep 2, ep 4) equal to one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from parallel_attention.transformer.model import GPTModel
from parallel_attention.transformer.model_config import ModelConfig
from parallel_attention.transformer.moe import MoELayer, moe_step, update_expert_bias
from parallel_attention.transformer.moe.router import top_k_lowest_id
from tests.distributed import run_distributed

H, E, K, F_EXPERT, F_SHARED = 16, 6, 2, 24, 8  # awkward sizes: a swapped or mis-sliced dimension cannot pass


def moe_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=H, num_layers=2, num_heads=2, activation="swiglu", norm="rmsnorm",
                position_embedding="rotary", num_experts=E, moe_top_k=K, moe_ffn_hidden_size=F_EXPERT,
                moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, max_seq_len=32)
    return ModelConfig(**{**base, **overrides})


def reference_moe(sd: dict, x: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [T, h], aux + z loss): token by token, expert by expert, from the canonical weights. With
    cfg.moe_capacity_factor, an expert past ceil(factor T K / E) tokens takes no more (tokens in order)."""
    logits = x @ sd["gate.weight"].t()
    scores = torch.softmax(logits, -1) if cfg.moe_router_score == "softmax" else torch.sigmoid(logits)
    y = torch.zeros_like(x)
    counts = torch.zeros(E, dtype=x.dtype)
    capacity = math.ceil(cfg.moe_capacity_factor * x.shape[0] * K / E) if cfg.moe_capacity_factor else x.shape[0]
    for t in range(x.shape[0]):
        ranked = sorted(range(E), key=lambda e: (-scores[t, e].item(), e))[:K]
        gates = scores[t, ranked]
        gates = gates / gates.sum() if cfg.moe_router_renormalize else gates
        for e, g in zip(ranked, gates):
            counts[e] += 1
            if counts[e] > capacity:  # dropped: the aux loss still counts the router's choice
                continue
            gate, up = (x[t] @ sd["experts.gate_up_proj"][e].t()).chunk(2)
            y[t] = y[t] + g * ((F.silu(gate) * up) @ sd["experts.down_proj"][e].t())
    if cfg.moe_shared_expert_ffn_hidden_size:
        shared = (F.silu(x @ sd["shared_expert.gate_proj.weight"].t()) * (x @ sd["shared_expert.up_proj.weight"].t())
                  ) @ sd["shared_expert.down_proj.weight"].t()
        y = y + shared * torch.sigmoid(x @ sd["shared_expert_gate.weight"].t())
    T = x.shape[0]
    shares = scores / scores.sum(-1, keepdim=True)  # sigmoid scores as a distribution per token (DeepSeek-V3)
    aux = cfg.moe_aux_loss_coeff * E * ((counts / (T * K)) * shares.mean(0)).sum()
    z = cfg.moe_z_loss_coeff * torch.logsumexp(logits, -1).pow(2).mean()
    return y, aux + z


def _canonical(layer: MoELayer, grad: bool = False) -> dict[str, torch.Tensor]:
    """The layer's weights (or their gradients) under the canonical names the reference reads."""
    of = (lambda p: p.grad) if grad else (lambda p: p)  # noqa: E731
    e = layer.experts
    sd = {"gate.weight": of(layer.gate.weight), "experts.gate_up_proj": of(e.gate_up_proj),
          "experts.down_proj": of(e.down_proj)}
    if layer.shared_expert is not None:
        gate, up = of(layer.shared_expert.fc_in.weight).split(layer.shared_expert.ffn_hidden_size)
        sd.update({"shared_expert.gate_proj.weight": gate, "shared_expert.up_proj.weight": up,
                   "shared_expert.down_proj.weight": of(layer.shared_expert.fc_out.weight),
                   "shared_expert_gate.weight": of(layer.shared_expert_gate.weight)})
    return sd


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("variant", [dict(), dict(moe_router_score="sigmoid", moe_shared_expert_ffn_hidden_size=F_SHARED,
                                                   moe_shared_expert_gate=True, moe_router_renormalize=False)])
def test_layer_matches_the_reference_with_every_gradient_and_the_aux_losses(dtype, tolerance, variant):
    """float64 runs the experts' loop, float32 torch._grouped_mm; both against the reference in float64. The
    auxiliary losses' gradient (scaled by the step's scale) is in every weight's gradient, the router's included."""
    cfg = moe_config(**variant)
    torch.manual_seed(0)
    layer = MoELayer(cfg, dtype=dtype)
    assert ("loop" in layer.active_paths()["experts"]) == (dtype == torch.float64)
    x = torch.randn(10, 1, H, dtype=dtype, requires_grad=True)
    upstream = torch.randn(10, 1, H, dtype=dtype)
    scale = 0.375
    with moe_step(scale) as record:
        (layer(x) * upstream).sum().backward()
    sd = {k: v.detach().double().requires_grad_() for k, v in _canonical(layer).items()}
    x_ref = x.detach().double().reshape(10, H).requires_grad_()
    y_ref, aux_ref = reference_moe(sd, x_ref, cfg)
    ((y_ref * upstream.double().reshape(10, H)).sum() + scale * aux_ref).backward()
    torch.testing.assert_close(x.grad.double().reshape(10, H), x_ref.grad, rtol=tolerance, atol=tolerance)
    for name, grad in _canonical(layer, grad=True).items():
        torch.testing.assert_close(grad.double(), sd[name].grad, rtol=tolerance, atol=tolerance, msg=name)
    aux, z = record.rows[0][0][:2].double()
    torch.testing.assert_close(aux + z, aux_ref.detach(), rtol=tolerance, atol=tolerance)
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double().reshape(10, H), y_ref.detach(), rtol=tolerance, atol=tolerance)


def test_ties_choose_the_lowest_expert_id_and_an_expert_without_tokens_is_fine():
    scores = torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.1, 0.7, 0.7, 0.2]])
    assert top_k_lowest_id(scores, 2).tolist() == [[0, 1], [1, 2]]
    torch.manual_seed(0)
    layer = MoELayer(moe_config())
    with torch.no_grad():
        layer.gate.weight.zero_()  # every score equal: every token to experts 0 and 1, the others get none
    x = torch.randn(7, 1, H, requires_grad=True)
    with moe_step() as record:
        layer(x).sum().backward()
    assert record.metrics(moe_config(num_layers=1))["moe_load/0"] == pytest.approx(E / K)
    assert layer.experts.gate_up_proj.grad[2:].abs().sum() == 0 and layer.experts.gate_up_proj.grad[:2].abs().sum() > 0


def test_balancing_bias_moves_against_the_load_and_steers_the_choice_only():
    cfg = moe_config(moe_router_bias_update_rate=0.25, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
    torch.manual_seed(0)
    model = GPTModel(cfg)
    tokens = torch.randint(0, 64, (2, 12))
    model(tokens, tokens).backward()
    counts = [layer.mlp.gate.step_counts.clone() for layer in model.layers]
    update_expert_bias(model)
    for layer, c in zip(model.layers, counts):
        assert c.sum() == 2 * 12 * K
        torch.testing.assert_close(layer.mlp.gate.e_score_correction_bias, 0.25 * torch.sign(c.mean() - c))
        assert layer.mlp.gate.step_counts.sum() == 0
    assert "layers.0.mlp.gate.e_score_correction_bias" in model.canonical_state_dict()


def test_dense_stays_the_default_and_moe_layers_follow_the_config():
    assert not ModelConfig().is_moe_layer(0)
    cfg = moe_config(num_layers=6, moe_layer_freq=2, moe_first_dense_layers=2)
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, False, False, True, False, True]


def _expert_parallel_worker(ep: int, world: int):
    """Each rank runs its 1/world of the tokens through the layer (8 experts) at `ep`; returns what one process
    compares."""
    import parallel_attention as pa
    from parallel_attention.check.collective_counter import count_collectives
    from parallel_attention.tensor_parallel.param_kinds import finalize_grads

    pa.destroy_model_parallel()
    pa.initialize_model_parallel(1, expert_model_parallel_size=ep)
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    layer = MoELayer(moe_config(num_experts=8))
    torch.manual_seed(1)
    x = torch.randn(8 * world, 1, H)
    if ep == 4:  # every token to expert 5: the other ranks' experts get nothing, and it still finishes
        x = x.abs()
        with torch.no_grad():
            layer.gate.weight.zero_()
            layer.gate.weight[5] = 1.0
    upstream = torch.randn(8 * world, 1, H)
    mine = x.chunk(world)[rank].requires_grad_()
    with moe_step(1.0), count_collectives() as counts:
        y = layer(mine)
        forward = dict(counts)
        (y * upstream.chunk(world)[rank]).sum().backward()
    backward = {k: v - forward.get(k, 0) for k, v in counts.items()}
    finalize_grads(layer)  # the experts' average over the ranks holding them (DDP would average the router)
    router_grad = layer.gate.weight.grad.clone()
    torch.distributed.all_reduce(router_grad)  # what DDP's average over dp does to a replicated parameter
    router_grad /= world
    canonical = layer_canonical_grads(layer)
    return y.detach(), router_grad, canonical, forward, backward


def layer_canonical_grads(layer: MoELayer) -> dict[str, torch.Tensor]:
    from parallel_attention.tensor_parallel.collectives import all_gather_along_dim

    return {n: all_gather_along_dim(getattr(layer.experts, n).grad, 0, layer.ep_group)
            for n in ("gate_up_proj", "down_proj")}


@pytest.mark.parametrize("ep,world", [(2, 2), (4, 4)])
def test_expert_parallel_equals_one_process_and_counts_its_all_to_alls(ep, world):
    """dp = world ranks, each with its own micro-batch; ep over them. Outputs, input gradients, the router's
    averaged gradient and every expert's averaged gradient equal one process running each micro-batch."""
    ranks = run_distributed(_expert_parallel_worker, world, 1, ep, world)
    torch.manual_seed(0)
    reference = MoELayer(moe_config(num_experts=8))
    torch.manual_seed(1)
    x = torch.randn(8 * world, 1, H)
    upstream = torch.randn(8 * world, 1, H)
    if ep == 4:
        x = x.abs()
        with torch.no_grad():
            reference.gate.weight.zero_()
            reference.gate.weight[5] = 1.0
    for chunk, grad_chunk in zip(x.chunk(world), upstream.chunk(world)):  # one micro-batch per rank, summed
        chunk = chunk.clone().requires_grad_()
        with moe_step(1.0 / world):  # the dp average, as the ranks' DDP and finalize_grads apply it
            (reference(chunk) * grad_chunk).sum().div(world).backward()
    for r, (y, router_grad, experts, forward, backward) in enumerate(ranks):
        with torch.no_grad():
            torch.testing.assert_close(y, reference(x.chunk(world)[r]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(router_grad, reference.gate.weight.grad, rtol=1e-5, atol=1e-7)
        for name, grad in experts.items():
            torch.testing.assert_close(grad, getattr(reference.experts, name).grad, rtol=1e-5, atol=1e-7)
        assert forward == {"all_to_all_single": 3}  # counts, dispatch, combine (no reduction: dp holds the tokens)
        assert backward == {"all_to_all_single": 2}  # combine's and dispatch's reverse


def test_kv_cache_decoding_and_bf16_autocast_run_through_moe_layers():
    """Generation: decoding with the cache gives the cache-free logits (no auxiliary losses outside training);
    under bf16 autocast a training forward and backward stay finite and reach the router."""
    torch.manual_seed(0)
    model = GPTModel(moe_config(moe_shared_expert_ffn_hidden_size=F_SHARED, moe_shared_expert_gate=True)).eval()
    tokens = torch.randint(0, 64, (2, 10))
    cache = model.new_kv_cache(2, 16)
    model.decode(tokens[:, :6], cache)
    # float32, the same weights: the cache changes only which positions each matmul sees at once
    torch.testing.assert_close(model.decode(tokens[:, 6:], cache), model.next_token_logits(tokens), rtol=1e-5,
                               atol=1e-6)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16), moe_step() as record:
        model(tokens, tokens).backward()
    assert torch.isfinite(model.layers[0].mlp.gate.weight.grad).all() and model.layers[0].mlp.gate.weight.grad.any()
    assert set(record.rows) == {0, 1}


def test_the_router_stays_float32_under_bf16_autocast():
    """Autocast would run the router's matmul in bf16: its logits, and so the choice among near ties, must be the
    float32 ones bit for bit."""
    torch.manual_seed(0)
    layer = MoELayer(moe_config())
    x = torch.randn(40, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routed = layer.gate(x)
    plain = layer.gate(x)
    assert routed.logits.dtype == torch.float32 and torch.equal(routed.logits, plain.logits)
    assert torch.equal(routed.expert_ids, plain.expert_ids)


@pytest.mark.slow
def test_compiled_moe_layers_train_like_eager():
    """model.compile (each layer through torch.compile; about 15 s of CPU to compile): the loss, the router's and
    the experts' gradients and the auxiliary losses of eager MoE layers (float32: the loop is traced where dynamo
    cannot fake torch._grouped_mm). The default run keeps the layer's own equivalence
    (test_layer_matches_the_reference_with_every_gradient_and_the_aux_losses)."""
    from parallel_attention.training.compile import compile_layers

    tokens, results = torch.randint(0, 64, (2, 12)), []
    for compiled in (True, False):
        torch.manual_seed(0)
        model = GPTModel(moe_config())
        if compiled:
            compile_layers(model)
        with moe_step(0.5) as record:
            loss = model(tokens, tokens)
            loss.backward()
        results.append((loss.detach(), model.layers[0].mlp.gate.weight.grad, model.layers[1].mlp.experts.down_proj.grad,
                        record.metrics(moe_config())["moe_aux_loss"]))
    for compiled, eager in zip(*results):
        torch.testing.assert_close(torch.as_tensor(compiled), torch.as_tensor(eager), rtol=1e-5, atol=1e-7)
