"""The replicated-parameter audit (`tensor_parallel.audit`, run by the trainer and by the self-check):
clean models pass at every layout; one rank's perturbed replica is found, named, and blamed on that rank,
across the tensor-parallel group (a norm, the k/v replicas of GQA at p = 4) and the data-parallel group."""

from __future__ import annotations

import pytest
import torch

import parallel_attention as pa
from distributed import run_distributed
from parallel_attention import GPTModel, ModelConfig
from parallel_attention.tensor_parallel import KvReplica, parameter_kinds
from parallel_attention.tensor_parallel.audit import replica_entries, replica_mismatches

# GQA with 2 k/v heads: at p = 4 each k/v head is replicated on two ranks (slots 0, 0, 1, 1)
SPEC = dict(vocab_size=203, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=16,
            ffn_hidden_size=48)
SHIFT = 0.0625  # exactly representable: the perturbed value is not rounded back to the original


def _perturb(model: GPTModel, target: str) -> None:
    with torch.no_grad():
        if target == "kv":  # one element of this rank's k/v replica rows
            param, kind = next(pk for pk in parameter_kinds(model).values()
                               if isinstance(pk[1], KvReplica))
            param[kind.rows][-1, 0] += SHIFT
        else:
            dict(model.named_parameters())[target].view(-1)[0] += SHIFT


def _audit_worker(sequence_parallel: bool, fault_rank: int, target: str):
    pa.manual_seed(0)
    model = GPTModel(ModelConfig(**SPEC), sequence_parallel=sequence_parallel)
    tp_group, dp_group = pa.get_tensor_model_parallel_group(), pa.get_data_parallel_group()
    clean = replica_mismatches(model, tp_group, dp_group)
    if torch.distributed.get_rank() == fault_rank:
        _perturb(model, target)
    return clean, replica_mismatches(model, tp_group, dp_group)


@pytest.mark.parametrize("world,tp,sp,fault_rank,target,expected", [
    (2, 2, False, 1, "final_norm.weight",
     "final_norm.weight differs across the tensor-parallel group: rank 0 vs rank 1"),
    (2, 2, True, 0, "layers.1.mlp.fc_out.bias",  # PartialGrad under sequence parallelism: audited the same way
     "layers.1.mlp.fc_out.bias differs across the tensor-parallel group: rank 0 vs rank 1"),
    (4, 4, False, 3, "kv",  # k/v head 1 lives on ranks 2 and 3 only: rank 3 differs from 2, not from 0 or 1
     "layers.0.attention.query_key_value.weight[k/v replica rows] (k/v slot 1) differs across the "
     "tensor-parallel group: rank 2 vs rank 3"),
    (4, 4, False, 1, "embed_positions",  # a majority: the odd rank is named as the one that differs
     "embed_positions differs across the tensor-parallel group: ranks 0, 2, 3 agree, rank 1 differs"),
    (2, 1, False, 1, "layers.0.attention.dense.weight",
     "layers.0.attention.dense.weight differs across the data-parallel group: rank 0 vs rank 1"),
], ids=["p2-norm", "p2-sp-bias", "p4-gqa-kv-replica", "p4-majority", "dp2-weight"])
def test_one_perturbed_rank_is_named(world, tp, sp, fault_rank, target, expected):
    results = run_distributed(_audit_worker, world, tp, sp, fault_rank, target)
    assert all(clean == [] for clean, _ in results)
    for rank, (_, found) in enumerate(results):
        assert found == [expected], f"rank {rank}: {found}"  # every rank of the group reaches the same verdict


def _tp_and_dp_worker():
    pa.manual_seed(0)
    model = GPTModel(ModelConfig(**SPEC), sequence_parallel=False)
    if torch.distributed.get_rank() == 3:  # tp rank 1 of data-parallel replica 1
        _perturb(model, "layers.0.input_norm.bias")
    return replica_mismatches(model, pa.get_tensor_model_parallel_group(), pa.get_data_parallel_group())


def test_p2_dp2_names_both_groups_and_only_their_members():
    results = run_distributed(_tp_and_dp_worker, 4, 2)
    tp = "layers.0.input_norm.bias differs across the tensor-parallel group: rank 2 vs rank 3"
    dp = "layers.0.input_norm.bias differs across the data-parallel group: rank 1 vs rank 3"
    assert results == [[], [dp], [tp], [tp, dp]]


def test_entries_follow_the_declared_kinds():
    model = GPTModel(ModelConfig(**SPEC), sequence_parallel=False)  # p = 1: nothing sharded across ranks
    tensor_parallel, data_parallel = replica_entries(model)
    assert [e.name for e in data_parallel] == [n for n, _ in model.named_parameters()]
    assert "final_norm.weight" in [e.name for e in tensor_parallel]
    assert replica_mismatches(model, None, None) == []  # world of one: nothing to compare, no collective
