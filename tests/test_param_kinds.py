"""Parameter kinds and their readers: the declared kinds, the global gradient norm (each parameter
counted once at every p), the optimizer's weight-decay groups, and dtype reaching every parameter."""

from __future__ import annotations

import math

import pytest
import torch

import parallel_attention as pa
from distributed import run_distributed
from parallel_attention import GPTModel, ModelConfig
from parallel_attention.tensor_parallel import KvReplica, PartialGrad, Replicated, Sharded, parameter_kinds
from parallel_attention.training import OptimizerConfig
from parallel_attention.training import global_grad_norm
from parallel_attention.training import build_optimizer

# GQA with 2 k/v heads: at p = 4 each k/v head has two replicas (KvReplica rows); learned positions and
# LayerNorm biases give replicated parameters; vocab 203 needs padding at every p.
SPEC = dict(vocab_size=203, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=16,
            ffn_hidden_size=48)
REPLICATED_SCALE = 100.0  # replicated parameters dominate the norm: counting one twice moves it by far more than 1e-6


def _canonical_for_norm(model: GPTModel) -> dict[str, torch.Tensor]:
    """Random canonical weights (same at every p) with the replicated ones scaled up."""
    generator = torch.Generator().manual_seed(11)
    canonical = {}
    for name, shape in model.canonical_shapes().items():
        t = torch.randn(shape, generator=generator, dtype=torch.float64).float()
        replicated = "norm" in name or name.endswith("o_proj.bias") or name.endswith("fc_out.bias") \
            or name.startswith("embed_positions")
        canonical[name] = t * REPLICATED_SCALE if replicated else t
    return canonical


def _norm_worker(sequence_parallel):
    """Set every gradient to its own weight, so the one-rank norm is the norm of the canonical weights."""
    pa.manual_seed(0)
    model = GPTModel(ModelConfig(**SPEC), sequence_parallel=sequence_parallel)
    canonical = _canonical_for_norm(model)
    model.load_canonical_state_dict(canonical)
    for p in model.parameters():
        p.grad = p.detach().clone()
    expected = math.sqrt(sum(t.double().pow(2).sum().item() for t in canonical.values()))
    kinds = {name: type(kind).__name__ for name, (_, kind) in parameter_kinds(model).items()}
    return global_grad_norm(model, pa.get_tensor_model_parallel_group()).item(), expected, kinds


@pytest.mark.parametrize("world_size,sequence_parallel", [(1, False), (2, False), (2, True), (4, False), (4, True)])
def test_global_norm_counts_every_parameter_once(world_size, sequence_parallel):
    for norm, expected, _ in run_distributed(_norm_worker, world_size, world_size, sequence_parallel):
        # float32 sums of ~60k squares in another order per p: 1e-6 relative; counting a replicated
        # parameter twice (or a sharded one once per rank too few) changes the norm by > 10 %
        assert norm == pytest.approx(expected, rel=1e-6)


def test_declared_kinds_at_p4_with_sequence_parallelism():
    _, _, kinds = run_distributed(_norm_worker, 4, 4, True)[0]
    assert kinds["embed_tokens.weight"] == "Sharded" and kinds["layers.0.mlp.fc_in.weight"] == "Sharded"
    assert kinds["layers.0.attention.dense.weight"] == "Sharded"
    # p = 4 > num_kv_heads = 2: the fused QKV holds k/v replicas
    assert kinds["layers.0.attention.query_key_value.weight"] == "KvReplica"
    for name in ("embed_positions", "layers.1.input_norm.weight", "layers.1.input_norm.bias", "final_norm.bias",
                 "layers.0.attention.dense.bias", "layers.0.mlp.fc_out.bias"):
        assert kinds[name] == "PartialGrad", name  # replicated, but each rank saw only its tokens


def test_kinds_without_sequence_parallelism_or_replicas():
    model = GPTModel(ModelConfig(**SPEC))
    kinds = {name: kind for name, (_, kind) in parameter_kinds(model).items()}
    assert isinstance(kinds["layers.0.attention.query_key_value.weight"], Sharded)
    assert kinds["layers.0.attention.query_key_value.weight"].dim == 0
    assert kinds["layers.0.attention.dense.weight"] == Sharded(1, None)
    assert isinstance(kinds["final_norm.weight"], Replicated) and isinstance(kinds["embed_positions"], Replicated)
    assert not any(isinstance(k, (PartialGrad, KvReplica)) for k in kinds.values())


def test_optimizer_decays_matrices_only():
    model = GPTModel(ModelConfig(**SPEC))
    optimizer = build_optimizer(model, OptimizerConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = ({names[id(p)] for p in g["params"]} for g in optimizer.param_groups)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert decay | no_decay == set(names.values()) and not decay & no_decay
    assert no_decay == {n for n in names.values() if n.endswith(".bias") or "norm" in n}
    assert {"embed_tokens.weight", "embed_positions", "layers.0.attention.query_key_value.weight",
            "layers.1.mlp.fc_out.weight"} <= decay


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_reaches_every_parameter(dtype):
    for spec in (SPEC, dict(SPEC, activation="swiglu", norm="rmsnorm", position_embedding="rotary",
                            tie_embeddings=False)):
        model = GPTModel(ModelConfig(**spec), dtype=dtype)
        wrong = {n: p.dtype for n, p in model.named_parameters() if p.dtype != dtype}
        assert not wrong, wrong


def test_the_old_partial_name_is_refused_naming_what_replaces_it():
    """`Partial` (0.2, deprecated in 0.3) was removed in 0.4: asking for it names PartialGrad and KvReplica."""
    for module in (pa.tensor_parallel, pa.tensor_parallel.param_kinds):
        with pytest.raises(AttributeError, match=r"Partial was removed in 0\.4: declare PartialGrad .* or KvReplica"):
            module.Partial  # noqa: B018
        with pytest.raises(AttributeError, match=r"has no attribute 'Partal'"):
            module.Partal  # noqa: B018
    with pytest.raises(ImportError, match="Partial"):
        from parallel_attention.tensor_parallel import Partial  # noqa: F401


def test_with_no_gradient_the_norm_is_a_zero_on_the_models_device():
    """NCCL reduces no CPU tensor: a rank without gradients reduces a zero on the model's device (meta here stands
    for CUDA: any device but the CPU shows the choice)."""
    model = pa.ColumnParallelLinear(6, 4, tp_group=None, device="meta")
    norm = global_grad_norm(model, None)
    assert (norm.device.type, norm.dtype, norm.shape) == ("meta", torch.float32, ())
