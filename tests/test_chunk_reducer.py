"""The data-parallel average of a pipeline stage (training.chunk_reducer.ChunkReducer): a chunk's buckets start
during its last backward of the step (before the schedule ends), earlier backwards and other chunks start nothing,
and after `finish` every gradient is the mean over the ranks of what each accumulated."""

from __future__ import annotations

import torch
import torch.distributed as dist

from distributed import run_distributed


def _chunks() -> list[torch.nn.Module]:
    torch.manual_seed(0)  # the same weights on every rank
    return [torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)), torch.nn.Linear(3, 2)]


def _reduce_two_micro_batches() -> dict:
    from parallel_attention.training.chunk_reducer import ChunkReducer

    rank = dist.get_rank()
    chunks = _chunks()
    # a tiny bucket size: every parameter its own bucket, so that the posting order is visible
    reducer = ChunkReducer([list(c.parameters()) for c in chunks], dist.group.WORLD, bucket_mb=1e-6)
    posted = []
    for micro in range(2):  # chunk 1 finishes its backwards first, as a pipeline's later chunk does
        x = torch.full((4, 5), float(rank + 1 + micro))
        for chunk in (1, 0):
            last = micro == 1
            with reducer.backward(chunk, last):
                sum(p.sum() for p in chunks[chunk].parameters()).mul(x.mean()).backward()
            posted.append(sorted(reducer.pending))
    grads = {n: p.grad.clone() for c, m in enumerate(chunks) for n, p in m.named_parameters(prefix=str(c))}
    reducer.finish()
    return {"posted": posted, "local": grads,
            "reduced": {n: p.grad for c, m in enumerate(chunks) for n, p in m.named_parameters(prefix=str(c))}}


def test_each_chunk_averages_during_its_last_backward():
    ranks = run_distributed(_reduce_two_micro_batches, 2)
    # 3 buckets of chunk 0 (buckets 0-3: two linears' weights and biases), chunk 1's two (buckets 4, 5)
    first_step, chunk1_last, chunk0_last = ranks[0]["posted"][1], ranks[0]["posted"][2], ranks[0]["posted"][3]
    assert first_step == [] and chunk1_last == [4, 5] and chunk0_last == [0, 1, 2, 3, 4, 5]
    for name, reduced in ranks[0]["reduced"].items():
        mean = (ranks[0]["local"][name] + ranks[1]["local"][name]) / 2
        torch.testing.assert_close(reduced, mean, rtol=0, atol=0)  # two ranks: a + b is exact either way
        torch.testing.assert_close(ranks[1]["reduced"][name], reduced, rtol=0, atol=0)
