"""Tokens to their experts and back: sorted by expert, across the expert-parallel group when ep > 1.

    x [T, h], the T k (token, choice) slots' experts (capacity.py: dropless, or E where capacity dropped one)
      | permute: the kept slots as rows sorted by global expert id (stable: ties keep token order)
      | ep > 1: exchange the counts [ep, E/ep] (all-to-all), then the rows (all-to-all, uneven splits): rank j
      |         gets the rows of its experts from every rank, in rank order; sorted by its local expert
      | the local experts on their rows (GroupedExperts)
      | ep > 1: the rows back to where they came from (all-to-all, the reverse splits)
      | combine: each row times its gate, summed into its token (index_add in the sorted order)
    y [T, h]

Per MoE layer at ep > 1: forward 3 all-to-alls (counts, dispatch, combine), backward 2 (combine's and
dispatch's reverse). An expert or a rank that receives no row is fine. The row order into each expert is the
global sort, so the result is the one process's at every ep.
"""

from __future__ import annotations

from typing import Callable

import torch

from ...tensor_parallel.collectives import all_to_all_counts, all_to_all_rows
from ...tensor_parallel.parallel_state import ProcessGroup, group_rank, group_size
from .capacity import Slots


def _local_experts(x_sorted: torch.Tensor, counts: torch.Tensor, experts: Callable) -> torch.Tensor:
    return experts(x_sorted, counts)


class ExpertDispatch:
    """Runs `experts` (this rank's E/ep experts, global ids ep_rank E/ep ...) on the rows routed to them."""

    def __init__(self, num_experts: int, ep_group: ProcessGroup | None) -> None:
        self.ep_group = ep_group
        self.ep_size, self.ep_rank = group_size(ep_group), group_rank(ep_group)
        self.num_local = num_experts // self.ep_size
        self._run = _local_experts if self.ep_size == 1 else self._across_ranks

    def __call__(self, x: torch.Tensor, slots: Slots, gates: torch.Tensor, experts: Callable) -> torch.Tensor:
        """y [T, h] from the kept `slots` (capacity.py: expert E marks a dropped one) and gates [T, k]."""
        order = torch.argsort(slots.experts, stable=True)[:slots.kept]  # the dropped slots sort last
        token = order // gates.shape[1]
        y_sorted = self._run(x[token], slots.counts, experts)
        weighted = (y_sorted.to(gates.dtype) * gates.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
        return x.new_zeros(x.shape).index_add(0, token, weighted)

    def _across_ranks(self, x_sorted: torch.Tensor, counts: torch.Tensor, experts: Callable) -> torch.Tensor:
        ep, local = self.ep_size, self.num_local
        received = all_to_all_counts(counts.view(ep, local), self.ep_group)  # [source rank, local expert]
        sent_rows = counts.view(ep, local).sum(1).tolist()
        received_rows = received.sum(1).tolist()
        rows = all_to_all_rows(x_sorted, received_rows, sent_rows, self.ep_group, "moe_dispatch")
        expert_of_row = torch.repeat_interleave(torch.arange(local, device=counts.device).repeat(ep),
                                                received.reshape(-1))
        by_expert = torch.argsort(expert_of_row, stable=True)
        y = experts(rows[by_expert], received.sum(0))
        back = y[torch.argsort(by_expert)]  # the received order again
        return all_to_all_rows(back, sent_rows, received_rows, self.ep_group, "moe_combine")
