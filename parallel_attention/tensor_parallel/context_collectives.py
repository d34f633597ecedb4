"""The context-parallel collectives: the ring's point-to-point exchange and the all-to-all of Ulysses.

A sibling of `collectives` (which holds every other collective and is at its length budget); each call goes through
the same `collectives.issuing` (timeouts named, the collective guard when enabled). Each function takes its group and
returns at once when the group has one rank.

    name                      forward                                         backward
    ring_exchange             send to the next rank, receive from the previous (no autograd: the ring's Function
                              (isend + irecv, asynchronous)                    rings its own gradients back)
    all_to_all_along_dims     split dim a into cp pieces, piece j to rank j,   the reverse all-to-all
                              the pieces received concatenated along dim b
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives
from .parallel_state import ProcessGroup, group_rank, group_size


class PendingExchange:
    """A posted ring exchange: wait() returns the tensor received from the previous rank."""

    def __init__(self, works, group: ProcessGroup, received: torch.Tensor) -> None:
        self.works, self.group, self.received = works, group, received

    def wait(self) -> torch.Tensor:
        with collectives.awaiting("ring_exchange", self.group):
            for work in self.works:
                work.wait()
        return self.received


@torch.no_grad()
def ring_exchange(x: torch.Tensor, group: ProcessGroup | None, tag: int = 0) -> PendingExchange | None:
    """Post: send `x` to the next rank of `group` and receive a tensor like it from the previous one (one isend and
    one irecv, asynchronous; compute on what you hold meanwhile, then wait()). None at one rank. Exchanges posted
    together take distinct tags."""
    size = group_size(group)
    if size == 1:
        return None
    rank = group_rank(group)
    x, received = x.contiguous(), torch.empty_like(x)
    with collectives.issuing("ring_exchange", x, group):
        send = dist.isend(x, dst=dist.get_global_rank(group, (rank + 1) % size), group=group, tag=tag)
        recv = dist.irecv(received, src=dist.get_global_rank(group, (rank - 1) % size), group=group, tag=tag)
    return PendingExchange((send, recv), group, received)


def _all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, group: ProcessGroup) -> torch.Tensor:
    size = group_size(group)
    pieces = torch.stack(x.chunk(size, dim=split_dim)).contiguous()  # [cp, ...]: piece j goes to rank j
    out = torch.empty_like(pieces)
    with collectives.issuing("all_to_all", pieces, group):
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
    """Forward: split `split_dim` into cp equal pieces, send piece j to rank j, concatenate the pieces received
    (in rank order) along `cat_dim` (e.g. heads -> sequence). Backward: the reverse all-to-all."""
    return x if group_size(group) == 1 else _AllToAll.apply(x, split_dim, cat_dim, group)

