"""Each pipeline schedule's measured bubble against its formula, with stages made of timed sleeps (no CPU
contention: p processes on any host), and stage 0's peak activation memory against the number of micro-batches.

    python benchmarks/pipeline_bubble.py --stages 4 --micro-batches 8 --step-ms 20

A stage's forward sleeps t, its backward 2t (zero bubble: the input gradient t, the weight gradient t, deferred
through tensor_parallel/weight_grads like the linears' own). The runner is the trainer's (`pipeline/runner.py`),
its exchanges the library's batched ones over gloo. Prints one JSON object: per schedule the measured bubble
(1 - compute summed over stages / (stages x the longest span), the median of --repeats steps) and the formula.
Memory: stage 0's peak bytes of tensors saved for backward (autograd's saved-tensor hooks, each counted until
freed), for m and 2m micro-batches: flat under 1f1b, growing with m under gpipe.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPE = (16, 2, 64)  # [s, b, h] of the activation passed between stages


class _Sleep(torch.autograd.Function):
    """y = x * w; forward sleeps t, backward t for dX and t for dW (deferred under zero bubble)."""

    @staticmethod
    def forward(ctx, x, weight, seconds):
        time.sleep(seconds)
        ctx.save_for_backward(x, weight)
        ctx.seconds = seconds
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        from parallel_attention.tensor_parallel.weight_grads import weight_grad

        x, weight = ctx.saved_tensors
        time.sleep(ctx.seconds)

        def weight_gradient():
            time.sleep(ctx.seconds)
            return (grad * x).sum().reshape(weight.shape)
        return grad * weight, weight_grad(weight_gradient, weight), None


class SleepStage(torch.nn.Module):
    """A stage of the benchmark: every chunk one sleeping layer; the first makes its input, the last a loss."""

    def __init__(self, seconds: float, first: bool, last: bool, chunks: int, rank: int, stages: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.seconds, self.chunks = seconds, chunks
        self.first = [first and c == 0 for c in range(chunks)]
        self.last = [last and c == chunks - 1 for c in range(chunks)]

    def forward(self, tokens, labels=None, hidden=None, chunk: int = 0):
        x = torch.ones(SHAPE) if self.first[chunk] else hidden
        y = _Sleep.apply(x, self.weight, self.seconds)
        return y.mean() if self.last[chunk] else y


def _run(rank: int, stages: int, micro: int, seconds: float, repeats: int, init: str, out) -> None:
    from parallel_attention.pipeline.runner import PipelineRunner
    from parallel_attention.pipeline.schedules import SCHEDULES, bubble_formula
    from parallel_attention.pipeline.step_record import measured_bubble
    from parallel_attention.tensor_parallel.mesh_groups import pipeline_link_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=stages,
                            timeout=datetime.timedelta(seconds=120))
    pp_group, links = dist.new_group(list(range(stages))), pipeline_link_groups(torch.arange(stages)[None], None)
    results, memory = {}, {}
    for name in SCHEDULES:
        v = 2 if SCHEDULES[name].chunked else 1
        model = SleepStage(seconds / v, rank == 0, rank == stages - 1, v, rank, stages)
        runner = PipelineRunner(model, name, micro, pp_group, links, v)
        runner.agree_shapes(SHAPE, torch.float32)
        bubbles = []
        for _ in range(repeats):
            dist.barrier()
            record = runner.run(_work(model, micro))
            compute = torch.tensor([record.compute_seconds()], dtype=torch.float64)
            span = torch.tensor([record.span_seconds()], dtype=torch.float64)
            dist.all_reduce(compute)
            dist.all_reduce(span, op=dist.ReduceOp.MAX)
            bubbles.append(measured_bubble(compute.item(), span.item(), stages))
        results[name] = {"measured": round(statistics.median(bubbles), 4),
                         "formula": round(bubble_formula(name, stages, micro, v), 4)}
    for name in ("gpipe", "1f1b"):
        memory[name] = {f"m={n}": _stage_peak_bytes(name, stages, n, pp_group, links, rank)
                        for n in (micro, 2 * micro)}
    if rank == 0:
        out.put((results, memory))
    dist.destroy_process_group()


def _work(model, micro: int):
    """The step's micro-batches through the library's one micro-batch contract (dummy tokens and labels)."""
    from parallel_attention.pipeline.micro_batch_step import MicroBatchStep

    return MicroBatchStep(model, [(torch.zeros(2, 16), torch.zeros(2, 16))] * micro)


def _stage_peak_bytes(name: str, stages: int, micro: int, pp_group, links, rank: int) -> int:
    """This stage's peak bytes of tensors saved for backward during one step (0 ms sleeps): measured by
    autograd's saved-tensor hooks, each tensor counted from when it is saved until it is freed."""
    import weakref

    from parallel_attention.pipeline.runner import PipelineRunner

    live, peak, seen = [0], [0], set()

    def pack(t):
        if isinstance(t, torch.nn.Parameter) or t.data_ptr() in seen:
            return t
        seen.add(t.data_ptr())
        live[0] += t.numel() * t.element_size()
        peak[0] = max(peak[0], live[0])
        weakref.finalize(t, _release, live, seen, t.data_ptr(), t.numel() * t.element_size())
        return t

    model = SleepStage(0.0, rank == 0, rank == stages - 1, 1, rank, stages)
    runner = PipelineRunner(model, name, micro, pp_group, links)
    runner.agree_shapes(SHAPE, torch.float32)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        runner.run(_work(model, micro))
    return peak[0]


def _release(live: list, seen: set, pointer: int, size: int) -> None:
    live[0] -= size
    seen.discard(pointer)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=20.0, help="a forward's sleep (backward: twice it)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = mp.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "store")
        procs = [context.Process(target=_run, args=(r, args.stages, args.micro_batches, args.step_ms / 1000,
                                                    args.repeats, init, out)) for r in range(args.stages)]
        for proc in procs:
            proc.start()
        results, memory = out.get(timeout=600)
        for proc in procs:
            proc.join(timeout=60)
    print(json.dumps({"stages": args.stages, "micro_batches": args.micro_batches, "bubble": results,
                      "stage0_peak_activation_bytes": memory}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
