"""Every collective of the package, in one module to follow: the timeout hook they all run in, the primitives (plain
and asynchronous), the context-parallel ring exchange and all-to-all, the pipeline's batched exchanges, and the
plain reductions and object exchanges that training and checkpointing use. The six tensor-parallel regions, the
autograd functions built on these primitives, are in `mappings`.

Each function takes the group it runs on, returns its input unchanged when the group has one rank (or is None), and
states what it does forward and backward. Shapes: `s` sequence, `b` batch, `h` hidden, `p` group size.

    name                                   forward                 backward
    all_to_all_along_dims                  split dim a, piece j to rank j, concatenate along dim b; the reverse
    all_to_all_rows                        rows [a_j] to rank j, rows from each rank in rank order; the reverse
                                           (uneven splits: expert-parallel dispatch and combine)
    all_to_all_counts                      [p, ...] counts, row j to rank j (no autograd; splits are exchanged first)
    ring_exchange                          send to the next rank, receive from the previous, batched (no autograd:
                                           the ring's own Function rings its gradients back)
    exchange                               any sends and receives as one batch_isend_irecv (pipeline stages)

Every call runs inside `issuing(op, tensor, group)` (an exchange's post inside the posting hook), and an
asynchronous one's wait() inside `awaiting(op, group)`: by default `named_timeouts`, which turns a backend's bare
timeout into CollectiveTimeoutError naming the operation and the group; the collective guard
(`collective_log.enable_collective_log`) installs its own contexts through `install_hooks`, which record each call
and cross-check it with the group's other ranks (before it runs; an exchange's, when it is waited for).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable

import torch
import torch.distributed as dist

from .parallel_state import (ProcessGroup, collective_timeout, describe_group, group_rank, group_size,
                             is_distributed)
from .sharding import check_sequence_split


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the groups' timeout: some rank stopped answering."""


# TORCH_DISTRIBUTED_DEBUG=DETAIL puts a monitored barrier before each collective: a rank missing there times out too
_TIMEOUT_WORDS = re.compile(r"timed out|timeout|failed to pass monitoredBarrier", re.IGNORECASE)


@contextlib.contextmanager
def named_timeouts(op: str, group: ProcessGroup | None):
    """Re-raise a backend's timeout (a bare RuntimeError) as CollectiveTimeoutError naming the operation, the group
    and the configured limit, so that the rank's log says what stopped answering."""
    try:
        yield
    except RuntimeError as error:  # gloo and NCCL (DistBackendError) report timeouts as RuntimeErrors
        if isinstance(error, CollectiveTimeoutError) or not _TIMEOUT_WORDS.search(str(error)):
            raise  # not a timeout, or one an inner collective already named
        raise CollectiveTimeoutError(
            f"{op} on the {describe_group(group)} did not complete within the timeout "
            f"({collective_timeout() or 'torch default'}): a rank stopped answering (hung, stopped or dead). "
            f"Backend said: {str(error).splitlines()[0]}") from error


def _plain(op: str, x: torch.Tensor | None, group: ProcessGroup | None):
    return named_timeouts(op, group)


_issue = _plain  # (op, tensor or None, group) -> the context a collective runs in
_await = named_timeouts  # (op, group) -> the context an asynchronous collective's wait() runs in
_post = _plain  # (op, tensor or None, group) -> the context an exchange (point-to-point batch) is posted in


def install_hooks(issue=None, await_=None, post=None) -> None:
    """From now on every collective runs in `issue(op, tensor or None, group)`, every exchange is posted in
    `post(op, tensor or None, group)` and every asynchronous wait() runs in `await_(op, group)`, all context
    managers (the collective guard's); None: the plain timeout hook."""
    global _issue, _await, _post
    _issue, _await, _post = issue or _plain, await_ or named_timeouts, post or _plain


def issuing(op: str, x: torch.Tensor | None, group: ProcessGroup | None):
    """The context every collective runs in (for those issued outside this module, such as FSDP2's)."""
    return _issue(op, x, group)


def awaiting(op: str, group: ProcessGroup | None):
    """The context an asynchronous collective's wait() runs in."""
    return _await(op, group)


def gather_into(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup | None, async_op: bool = False):
    """dist's all-gather into one tensor, outside the hooks (the guard's own signature exchange uses it)."""
    # torch >= 2.10 names it all_gather_single (all_gather_into_tensor warns); older releases lack it
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
        out, x, group=group, async_op=async_op)


def all_gather_into_tensor(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup, async_op: bool = False,
                           name: str = "all_gather"):
    """Every rank's `x` into `out`, stacked along dim 0 in rank order (FSDP2's all-gather runs through it, `name`d)."""
    with _issue(name, x, group):
        return gather_into(out, x, group, async_op)


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


class CompletedCollective:
    """A collective already waited for (or one a group of one rank needs not run): wait() returns its result."""

    def __init__(self, result: torch.Tensor) -> None:
        self.result = result

    def wait(self) -> torch.Tensor:
        return self.result


@torch.no_grad()
def all_reduce(x: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM, async_op: bool = False):
    """x reduced over `group` (summed by default) in place, outside autograd: the linears' reductions and statistics
    such as the loss's max and sums. A non-contiguous x is reduced as a contiguous copy, returned. With async_op, a
    PendingCollective of it (a CompletedCollective on a group of one rank)."""
    if group_size(group) == 1:
        return CompletedCollective(x) if async_op else x
    x = x.contiguous()
    with _issue("all_reduce", x, group):
        work = dist.all_reduce(x, op=op, group=group, async_op=async_op)
    return PendingCollective("all_reduce", work, group, x) if async_op else x


def all_gather_first_dim(x: torch.Tensor, group: ProcessGroup, async_op: bool = False):
    """All-gather [s/p, ...] chunks into [s, ...] in rank order.

    With async_op, a PendingCollective of it."""
    x = x.contiguous()
    out = torch.empty((group_size(group) * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
    work = all_gather_into_tensor(out, x, group, async_op)
    return PendingCollective("all_gather", work, group, out) if async_op else out


def reduce_scatter_first_dim(x: torch.Tensor, group: ProcessGroup, async_op: bool = False):
    """Sum the ranks' [s, ...] and keep this rank's [s/p, ...] chunk.

    With async_op, a PendingCollective of it."""
    p = group_size(group)
    check_sequence_split(x.shape[0], p)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // p,) + x.shape[1:], dtype=x.dtype, device=x.device)
    work = reduce_scatter_tensor(out, x, group, async_op)
    return PendingCollective("reduce_scatter", work, group, out) if async_op else out


def _all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, group: ProcessGroup) -> torch.Tensor:
    pieces = torch.stack(x.chunk(group_size(group), dim=split_dim)).contiguous()  # [p, ...]: piece j goes to rank j
    out = torch.empty_like(pieces)
    with _issue("all_to_all", pieces, group):
        dist.all_to_all_single(out, pieces, group=group)
    return torch.cat(out.unbind(0), dim=cat_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, cat_dim, group):
        ctx.dims, ctx.group = (split_dim, cat_dim), group
        return _all_to_all(x, split_dim, cat_dim, group)

    @staticmethod
    def backward(ctx, grad):
        split_dim, cat_dim = ctx.dims
        return _all_to_all(grad, cat_dim, split_dim, ctx.group), None, None, None


def all_to_all_along_dims(x: torch.Tensor, split_dim: int, cat_dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: split `split_dim` into p equal pieces, send piece j to rank j, concatenate the pieces received (in
    rank order) along `cat_dim` (e.g. heads -> sequence, Ulysses). Backward: the reverse all-to-all."""
    return x if group_size(group) == 1 else _AllToAll.apply(x, split_dim, cat_dim, group)


def _all_to_all_rows(x: torch.Tensor, received: list[int], sent: list[int], group: ProcessGroup,
                     op: str) -> torch.Tensor:
    out = x.new_empty((sum(received),) + tuple(x.shape[1:]))
    with _issue(op, x, group):
        dist.all_to_all_single(out, x.contiguous(), received, sent, group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, received, sent, group, op):
        ctx.splits, ctx.group, ctx.op = (received, sent), group, op
        return _all_to_all_rows(x, received, sent, group, op)

    @staticmethod
    def backward(ctx, grad):
        received, sent = ctx.splits
        return _all_to_all_rows(grad, sent, received, ctx.group, ctx.op), None, None, None, None


def all_to_all_rows(x: torch.Tensor, received: list[int], sent: list[int], group: ProcessGroup | None,
                    op: str = "all_to_all") -> torch.Tensor:
    """Forward: the first sent[j] rows of x (then the next sent[j+1], ...) go to rank j; this rank receives received[i]
    rows from rank i, concatenated in rank order (uneven splits; a zero is fine). Backward: the reverse exchange of
    the gradient. Named `op` in timeouts and the collective log (the experts' dispatch and combine)."""
    return x if group_size(group) == 1 else _AllToAllRows.apply(x, received, sent, group, op)


@torch.no_grad()
def all_to_all_counts(counts: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """counts [p, ...]: row j goes to rank j; returns [p, ...] whose row i came from rank i (no autograd)."""
    if group_size(group) == 1:
        return counts.clone()
    out = torch.empty_like(counts)
    with _issue("all_to_all", counts, group):
        dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


class PendingExchange:
    """A posted batch of sends and receives: wait() returns the received tensors, in the order asked for (the sent
    tensors are held until then); received_yet() says, without waiting, whether the receives have arrived."""

    def __init__(self, op: str, works, group: ProcessGroup | None, sent: list, received: list[torch.Tensor]) -> None:
        self.op, self.works, self.group, self.sent, self.received = op, works, group, sent, received

    def wait(self) -> list[torch.Tensor]:
        with _await(self.op, self.group):
            for work in self.works:
                work.wait()
        self.works = []
        return self.received

    def _per_operation(self) -> bool:
        """One work per send and receive (gloo); else one coalesced work for the batch (NCCL)."""
        return len(self.works) == len(self.sent) + len(self.received)

    def received_yet(self) -> bool:
        """Whether every receive has completed (without waiting; with one coalesced work, the whole batch)."""
        works = self.works[len(self.sent):] if self._per_operation() else self.works
        return all(work.is_completed() for work in works)


@torch.no_grad()
def exchange(sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]],
             group: ProcessGroup | None, op: str = "exchange") -> PendingExchange:
    """Post every send (tensor, group rank of the destination) and receive (buffer, group rank of the source) as
    ONE `batch_isend_irecv`, and return it pending. Never a bare isend then irecv: NCCL runs unbatched point-to-point
    operations of an eagerly initialised group one after another on one stream, so two ranks that each send first
    wait for each other's receive forever once a message outgrows NCCL's buffers. Named `op` in timeouts and logs."""
    c10d = dist.distributed_c10d  # P2POp accepts only these two functions, not torch.distributed's re-exports
    ops = [dist.P2POp(c10d.isend, t.contiguous(), dist.get_global_rank(group, dst) if group else dst, group)
           for t, dst in sends]
    ops += [dist.P2POp(c10d.irecv, t, dist.get_global_rank(group, src) if group else src, group)
            for t, src in receives]
    with _post(op, ops[0].tensor if ops else None, group):  # a receive's buffer has the shape of the send
        works = dist.batch_isend_irecv(ops) if ops else []
    return PendingExchange(op, works, group, [op_.tensor for op_ in ops[:len(sends)]], [t for t, _ in receives])


@torch.no_grad()
def ring_exchange(tensors: list[torch.Tensor], group: ProcessGroup | None) -> PendingExchange | None:
    """Post: send each of `tensors` to the next rank of `group` and receive one like it from the previous, all in one
    batched exchange (compute on what you hold meanwhile, then wait() for the received list). None at one rank."""
    size = group_size(group)
    if size == 1:
        return None
    rank = group_rank(group)
    return exchange([(t, (rank + 1) % size) for t in tensors],
                    [(torch.empty_like(t), (rank - 1) % size) for t in tensors], group, "ring_exchange")


@torch.no_grad()
def all_gather_along_dim(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Plain (no autograd) all-gather of the ranks' shards along `dim`, in rank order: for full weights."""
    if group_size(group) == 1:
        return x.clone()
    return all_gather_first_dim(x.movedim(dim, 0), group).movedim(0, dim).contiguous()


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


def raise_together(problem, error: Callable[[dict[int, Any]], BaseException], group: ProcessGroup | None = None,
                   cause: BaseException | None = None) -> None:
    """Every rank of `group` (default: the world) raises the same error, or none does: each rank states its
    `problem` (None: it has none; else anything picklable, such as a message), one all_gather shares them, and
    where any rank has one, every rank raises error({rank: problem} of the ranks that have one, in rank order).
    A rank that raised alone would leave the others waiting in their next collective until the timeout, and the
    job's report would name whichever rank failed first. `cause`: this rank's own exception, chained."""
    problems = {rank: found for rank, found in enumerate(all_gather_objects(problem, group)) if found is not None}
    if problems:
        raise error(problems) from cause


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
    flags = torch.tensor([1.0 if flag else 0.0], device=device)
    with _issue("all_reduce", flags, None):  # on the world (all_reduce takes a group of None as one rank)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags.item())


def barrier() -> None:
    if is_distributed():
        with _issue("barrier", None, None):
            dist.barrier()
