"""Every collective of the package: the tensor-parallel region as autograd functions, and the plain
(no-autograd) reductions and object exchanges that training and checkpointing use.

The only module that calls torch.distributed's collectives. Each function takes the group it runs on,
returns its input unchanged when the group has one rank (or is None), and states what it does forward
and backward. Shapes: `s` sequence, `b` batch, `h` hidden, `p` tensor-parallel size.

    name                                   forward                 backward
    copy_to_tensor_parallel_region         identity                all-reduce
    reduce_from_tensor_parallel_region     all-reduce              identity
    scatter_to_tensor_parallel_region      keep my last-dim chunk  all-gather last dim
    gather_from_tensor_parallel_region     all-gather last dim     keep my last-dim chunk
    gather_from_sequence_parallel_region   all-gather dim 0 (s)    reduce-scatter dim 0
    reduce_scatter_to_sequence_parallel_region  reduce-scatter dim 0  all-gather dim 0

Every call goes through `_issue(op, tensor, group)`: `named_timeouts`, or after `enable_collective_log()` the guard
of `collective_log`, which records the call and cross-checks it with the group's other ranks before it runs. An
async call (async_op=True, the fused linears of `linear_functions`) is issued alike; its PendingCollective.wait()
names timeouts.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from .collective_log import RECENT_CALLS, TORCH_DEBUG_ENV, CollectiveLog, CollectiveMismatchError, mismatch_report
from .parallel_state import ProcessGroup, describe_group, group_rank, group_size, is_distributed
from .sharding import check_sequence_split
from .timeouts import CollectiveTimeoutError, named_timeouts

__all__ = ["CollectiveMismatchError", "CollectiveTimeoutError", "enable_collective_log"]  # and the functions below


def _plain(op: str, x: torch.Tensor | None, group: ProcessGroup | None):
    return named_timeouts(op, group)


_issue = _plain  # (op, tensor or None, group) -> the context a collective runs in; the guard replaces it
_await = named_timeouts  # (op, group) -> the context an asynchronous collective's wait() runs in; likewise
_LOG: CollectiveLog | None = None


def issuing(op: str, x: torch.Tensor | None, group: ProcessGroup | None):
    """The context every collective runs in, for those issued outside this module (the ring's isend/irecv, the
    all-to-all): the timeout hook, or after `enable_collective_log()` the guard."""
    return _issue(op, x, group)


def awaiting(op: str, group: ProcessGroup | None):
    """The context an asynchronous collective's wait() runs in (the timeout hook, or the guard's)."""
    return _await(op, group)


def enable_collective_log(size: int = RECENT_CALLS) -> None:
    """The collective guard, for this process: from now on each collective is recorded (op, shape, dtype,
    group, call site) and its signature all-gathered across its group before it runs, so that diverging
    ranks raise CollectiveMismatchError naming each rank's first diverging call, and a timeout lists the
    recent calls. Also turns on torch's TORCH_DISTRIBUTED_DEBUG=DETAIL and the NCCL flight recorder for
    the groups created afterwards: call it before init_distributed. Costs a small all-gather per collective."""
    global _issue, _await, _LOG
    for name, value in TORCH_DEBUG_ENV.items():
        os.environ.setdefault(name, value)
    dist.set_debug_level_from_env()  # torch read the variable at import
    _LOG, _issue, _await = CollectiveLog(size), _guarded, _listing_recent


def _gather_into(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup | None, async_op: bool = False):
    # torch >= 2.10 names it all_gather_single (all_gather_into_tensor warns); older releases lack it
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
        out, x, group=group, async_op=async_op)


@contextlib.contextmanager
def _guarded(op: str, x: torch.Tensor | None, group: ProcessGroup | None):
    """Record the call, check it against the group's other ranks, then run it (timeouts list the recent calls)."""
    call = _LOG.record(op, x, group, describe_group(group))
    with _listing_recent(op, group):
        calls = _exchange_signatures(call, x, group)
    if calls is not None:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(calls)))
        raise CollectiveMismatchError(mismatch_report(call.group, ranks, calls))
    with _listing_recent(op, group):
        yield


@contextlib.contextmanager
def _listing_recent(op: str, group: ProcessGroup | None):
    """named_timeouts, and a timeout lists this rank's recent calls (the guard's wait of an asynchronous collective)."""
    try:
        with named_timeouts(op, group):
            yield
    except CollectiveTimeoutError as error:
        raise CollectiveTimeoutError(f"{error}\n{_LOG.recent(dist.get_rank())}") from error


def _exchange_signatures(call, x: torch.Tensor | None, group: ProcessGroup | None) -> list | None:
    """None if every rank of the group issues a call of this signature; else every rank's call and the ones
    before it (every rank of the group sees the disagreement, so every rank joins that second gather)."""
    nccl = x is None and dist.get_backend(group) == "nccl"
    device = x.device if x is not None else torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
    mine = torch.tensor(call.signature(), dtype=torch.int64, device=device)
    gathered = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.int64, device=device)
    _gather_into(gathered, mine, group)
    signatures = gathered.view(-1, mine.numel()).tolist()
    if all(s == signatures[0] for s in signatures):
        return None
    calls = [None] * len(signatures)
    dist.all_gather_object(calls, (call, _LOG.before(call, 3)), group=group)
    return calls


def all_gather_into_tensor(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup, async_op: bool = False,
                           name: str = "all_gather"):
    """Every rank's `x` into `out`, stacked along dim 0 in rank order (FSDP2's all-gather runs through it, `name`d)."""
    with _issue(name, x, group):
        return _gather_into(out, x, group, async_op)


def reduce_scatter_tensor(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup, async_op: bool = False,
                          reduce_op=dist.ReduceOp.SUM, name: str = "reduce_scatter"):
    """`x` reduced over the group, this rank's dim-0 chunk into `out` (FSDP2's reduce-scatter too, `name`d)."""
    with _issue(name, x, group):
        return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
            out, x, op=reduce_op, group=group, async_op=async_op)


class PendingCollective:
    """An async_op=True collective: wait() returns its result and names a timeout as the collective's own; on
    NCCL it makes the current CUDA stream wait for NCCL's (no CPU block)."""

    def __init__(self, op: str, work, group: ProcessGroup, result: torch.Tensor) -> None:
        self.op, self.work, self.group, self.result = op, work, group, result

    def wait(self) -> torch.Tensor:
        with _await(self.op, self.group):
            self.work.wait()
        return self.result


def all_reduce(x: torch.Tensor, group: ProcessGroup, op=dist.ReduceOp.SUM, async_op: bool = False):
    """x (made contiguous) summed over `group` in place; with async_op a PendingCollective (no autograd)."""
    x = x.contiguous()
    with _issue("all_reduce", x, group):
        work = dist.all_reduce(x, op=op, group=group, async_op=async_op)
    return PendingCollective("all_reduce", work, group, x) if async_op else x


def _split_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    p = group_size(group)
    if x.shape[-1] % p != 0:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by tensor-parallel size {p}.")
    return x.chunk(p, dim=-1)[group_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[..., n/p] -> [..., n]: gathered as [p, ..., n/p] (all_gather_into_tensor stacks along dim 0), then one
    copy into rank order along the last dim (no transposed copy of the input)."""
    p, x = group_size(group), x.contiguous()
    out = torch.empty((p * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
    all_gather_into_tensor(out, x, group)
    return out.view(p, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], p * x.shape[-1])


def all_gather_first_dim(x: torch.Tensor, group: ProcessGroup, async_op: bool = False):
    """[s/p, ...] chunks -> [s, ...] in rank order (async_op: a PendingCollective of it)."""
    x = x.contiguous()
    out = torch.empty((group_size(group) * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
    work = all_gather_into_tensor(out, x, group, async_op)
    return PendingCollective("all_gather", work, group, out) if async_op else out


def reduce_scatter_first_dim(x: torch.Tensor, group: ProcessGroup, async_op: bool = False):
    p = group_size(group)
    check_sequence_split(x.shape[0], p)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // p,) + x.shape[1:], dtype=x.dtype, device=x.device)
    work = reduce_scatter_tensor(out, x, group, async_op)
    return PendingCollective("reduce_scatter", work, group, out) if async_op else out


def _region_function(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd function that runs `forward(x, group)` on the way in and `backward(grad, group)` back."""

    def run_forward(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def run_backward(ctx, grad):
        return backward(grad, ctx.group), None

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(run_forward), "backward": staticmethod(run_backward)})


def _identity(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return x.view_as(x)


def _all_reduce_copy(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    # autograd may hand the same gradient to other branches, and the forward input is the caller's: reduce a copy
    return all_reduce(x.clone(), group)


# the table of the module docstring, row by row
_CopyToRegion = _region_function("_CopyToRegion", _identity, _all_reduce_copy)
_ReduceFromRegion = _region_function("_ReduceFromRegion", _all_reduce_copy, _identity)
_ScatterToRegion = _region_function("_ScatterToRegion", _split_last_dim, _gather_last_dim)
_GatherFromRegion = _region_function("_GatherFromRegion", _gather_last_dim, _split_last_dim)
_GatherFromSequenceRegion = _region_function("_GatherFromSequenceRegion", all_gather_first_dim,
                                             reduce_scatter_first_dim)
_ReduceScatterToSequenceRegion = _region_function("_ReduceScatterToSequenceRegion", reduce_scatter_first_dim,
                                                  all_gather_first_dim)


def copy_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce the gradient (the input fed every rank)."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: all-reduce the partial sums. Backward: identity."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: all-gather the last dim in rank order. Backward: keep this rank's chunk."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: all-gather [s/p, ...] chunks into [s, ...]. Backward: reduce-scatter along s."""
    return x if group_size(group) == 1 else _GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: sum the ranks' [s, ...] partials and keep chunk [s/p, ...]. Backward: all-gather along s."""
    return x if group_size(group) == 1 else _ReduceScatterToSequenceRegion.apply(x, group)


@torch.no_grad()
def all_gather_along_dim(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Plain (no autograd) all-gather of the ranks' shards along `dim`, in rank order: for full weights."""
    if group_size(group) == 1:
        return x.clone()
    return all_gather_first_dim(x.movedim(dim, 0), group).movedim(0, dim).contiguous()


@torch.no_grad()
def all_reduce_(x: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce outside autograd (for statistics such as the loss's max and sums)."""
    if group_size(group) > 1:
        with _issue("all_reduce", x, group):
            dist.all_reduce(x, op=op, group=group)
    return x


@torch.no_grad()
def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value on every rank of its mesh (an all-gather of FSDP2's data-parallel shards, for
    checkpoints); a plain tensor as it is. Every rank of the mesh calls it."""
    if getattr(x, "placements", None) is None:
        return x
    with _issue("all_gather", None, x.device_mesh.get_group()):
        return x.full_tensor()


def all_gather_objects(obj, group: ProcessGroup | None = None) -> list:
    """Every rank's `obj` (picklable) in the group (default: the world), in rank order; [obj] outside
    torch.distributed."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size(group)
    with _issue("all_gather_object", None, group):
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src: int = 0):
    """Global rank `src`'s `obj` on every rank; `obj` itself outside torch.distributed."""
    if not is_distributed():
        return obj
    box = [obj]
    with _issue("broadcast_object", None, None):
        dist.broadcast_object_list(box, src=src)
    return box[0]


@torch.no_grad()
def any_rank(flag: bool, device) -> bool:
    """True on every global rank if any rank says True (one small all-reduce)."""
    if not is_distributed():
        return flag
    return bool(all_reduce(torch.tensor([1.0 if flag else 0.0], device=device), None, dist.ReduceOp.MAX).item())


def barrier() -> None:
    if is_distributed():
        with _issue("barrier", None, None):
            dist.barrier()
