"""FP8 scales that do not depend on the layout: a column- and a row-parallel linear at TP 2 (with and without SP),
and a linear at DP 2 with global scales, compute one process's FP8 numbers; each amax MAX all-reduce is counted,
and skipping any one of them (on every rank alike) breaks the equality. Without global scales, DP 2 differs from one
process (the anchors' behaviour, which the docs state).

With power-of-two scales a wrong amax changes nothing but which values fall below the format's smallest numbers,
so the data sets one rank's share R = 2^32 times above the other's (e5m2 reaches 2^-16 below its largest value
57344: only a ratio past 2^32 flushes the small share), and pairs each large operand with a small one, so that both
ranks' shares weigh alike in every sum: a share flushed to zero by a missing all-reduce then moves the result.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from parallel_attention.check.collective_counter import count_collectives
from parallel_attention.tensor_parallel import linear_functions as fn
from parallel_attention.tensor_parallel import parallel_state as ps
from parallel_attention.tensor_parallel.collectives import all_reduce
from parallel_attention.tensor_parallel.linear_precision import fp8_linears

H, F, S, B = 16, 24, 8, 2  # B sequences per data-parallel rank
R = 2.0 ** 32
SAME, DIFFERENT = 1e-5, 1e-2  # float32 sums split over ranks differ by rounding; a flushed share by far more
# MAX all-reduces of one forward + backward: (recipe, layout) -> count (TP: the column and the row linear)
AMAX_REDUCTIONS = {("tensorwise", "tp"): 3, ("rowwise", "tp"): 2, ("tensorwise", "dp"): 2, ("rowwise", "dp"): 1}


def _halves(t: torch.Tensor, dim: int, first: float, second: float) -> torch.Tensor:
    """t with its first half along `dim` times `first`, its second half times `second`."""
    a, b = t.chunk(2, dim)
    return torch.cat([a * first, b * second], dim)


def _data():
    """(column W [F, H], X [S, 2B, H], dY [S, 2B, F]; row W [H, F], X [S, 2B, F], dY [S, 2B, H])."""
    g = torch.Generator().manual_seed(11)
    n = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    column = (_halves(n(F, H) * 0.1, 0, 1, R), n(S, 2 * B, H), _halves(n(S, 2 * B, F), 2, R, 1))
    row = (_halves(n(H, F) * 0.1, 1, 1, R), _halves(n(S, 2 * B, F), 2, R, 1), n(S, 2 * B, H))
    return column, row


def _linear(function, w, x, dy, comm):
    """(Y, dX, dW) of one linear through its autograd function."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = function(x, w, comm)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _column(x, w, comm):
    return fn.column_parallel_linear(x, w, None, comm)


@contextlib.contextmanager
def skipping_max_all_reduce(index):
    """The `index`-th MAX all-reduce of the block does nothing, on every rank (None: none skipped); yields the
    count of MAX all-reduces issued."""
    original, seen = dist.all_reduce, [0]

    def all_reduce_(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
        if op == dist.ReduceOp.MAX:
            seen[0] += 1
            if seen[0] - 1 == index:
                return None
        return original(tensor, op, *args, **kwargs)

    dist.all_reduce = all_reduce_
    try:
        yield seen
    finally:
        dist.all_reduce = original


def _relative(a, b):
    """max |a - b| relative to max |b| (a share all flushed to zero compares as 0 when a is zero too)."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def _one_process(recipe, function, w, x, dy, comm):
    with fp8_linears(recipe, "cpu"):
        return _linear(function, w, x, dy, comm)


def _tp_run(recipe, sequence_parallel, skip=None):
    """The largest relative error of this TP rank's parts of (Y, dX, dW), column and row, against one process's;
    and the MAX all-reduces counted."""
    group, ((cw, cx, cdy), (rw, rx, rdy)) = ps.get_tensor_model_parallel_group(), _data()
    p, r = ps.group_size(group), ps.group_rank(group)
    kinds = ((fn.SequenceParallelColumn, fn.SequenceParallelRow) if sequence_parallel
             else (fn.TensorParallelColumn, fn.TensorParallelRow))
    column, row = kinds[0](group, fn.wait_at_once), kinds[1](group)
    tokens = (lambda t: t.chunk(p, 0)[r]) if sequence_parallel else (lambda t: t)  # SP: this rank's s/p
    shard = lambda t, dim: t.chunk(p, dim)[r]  # noqa: E731
    with fp8_linears(recipe, "cpu"), skipping_max_all_reduce(skip) as seen:
        got = _linear(_column, shard(cw, 0), tokens(cx), shard(cdy, 2), column)
        got += _linear(fn.row_parallel_linear, shard(rw, 1), shard(rx, 2), tokens(rdy), row)
    cy, cdx, cdw = _one_process(recipe, _column, cw, cx, cdy, fn.LOCAL_COLUMN)
    ry, rdx, rdw = _one_process(recipe, fn.row_parallel_linear, rw, rx, rdy, fn.LOCAL_ROW)
    expected = (shard(cy, 2), tokens(cdx), shard(cdw, 0), tokens(ry), shard(rdx, 2), shard(rdw, 1))
    return max(_relative(a, b) for a, b in zip(got, expected)), seen[0]


def _dp_run(recipe, global_scales, skip=None):
    """The same for a linear at DP 2: this rank's tokens of Y and dX, dW summed over the ranks."""
    group, ((w, x, dy), _) = ps.get_data_context_parallel_group(), _data()
    x, dy = _halves(x, 1, R, 1), _halves(dy, 1, 1, R)  # rank 0's X and rank 1's dY large: dW's shares alike
    r = ps.group_rank(group)
    mine = lambda t: t[:, r * B:(r + 1) * B]  # noqa: E731
    with fp8_linears(recipe, "cpu", group if global_scales else None), skipping_max_all_reduce(skip) as seen:
        y, dx, dw = _linear(_column, w, mine(x), mine(dy), fn.LOCAL_COLUMN)
    dw = all_reduce(dw, group)
    ry, rdx, rdw = _one_process(recipe, _column, w, x, dy, fn.LOCAL_COLUMN)
    return max(_relative(y, mine(ry)), _relative(dx, mine(rdx)), _relative(dw, rdw)), seen[0]


def _layout_worker(recipe, layout):
    """Equal to one process with every all-reduce; off by at least FP8's steps without any one of them."""
    run = {"tp": lambda skip: _tp_run(recipe, False, skip), "sp": lambda skip: _tp_run(recipe, True, skip),
           "dp": lambda skip: _dp_run(recipe, True, skip)}[layout]
    expected = AMAX_REDUCTIONS[(recipe, "dp" if layout == "dp" else "tp")]
    with count_collectives(ps.get_data_context_parallel_group() if layout == "dp"
                           else ps.get_tensor_model_parallel_group()) as counts:
        error, seen = run(None)
    plain = {"tp": 2, "sp": 0, "dp": 1}[layout]  # the linears' own (TP: the row's Y, the column's dX; DP: dW's sum)
    assert (seen, counts["all_reduce"]) == (expected, expected + plain), (seen, counts)
    assert error <= SAME, f"{recipe} {layout}: {error} from one process"
    for skip in range(expected):
        error, _ = run(skip)
        assert error >= DIFFERENT, f"{recipe} {layout}: without MAX all-reduce #{skip} still equal ({error})"
    if layout == "dp":  # the default: each rank's own tokens; not one process's numbers
        assert _dp_run(recipe, False)[0] >= DIFFERENT
    return True


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("layout", ["tp", "sp", "dp"])
def test_fp8_layouts_equal_one_process(recipe, layout):
    tp = 1 if layout == "dp" else 2
    assert run_distributed(_layout_worker, 2, tp, recipe, layout, timeout=120) == [True, True]
