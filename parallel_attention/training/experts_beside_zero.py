"""ZeRO-1 beside experts split over an expert-parallel group (MoE at ep > 1 with zero_stage 1).

ZeRO-1 gives each parameter one owner among the dp x cp ranks, which updates it and broadcasts it to the others;
the split experts differ between the ranks of an ep group (each holds its own E/ep), so a broadcast would overwrite
them. They stay out of the sharding: each rank updates its own experts with an unsharded AdamW (the same fused
kernel with the same hyper-parameters), beside the sharded AdamW over every other parameter.

To the trainer and the checkpoints it is one AdamW: `param_groups` are the two weight-decay groups with every
parameter in the model's order (the learning rate set there reaches both optimizers at `step`), `state` holds each
parameter's moments that this rank keeps, and `state_dict()` (after `consolidate_state_dict`, on the rank it named)
is the state dict an unsharded AdamW over the same groups would return: checkpoints do not depend on zero_stage.
"""

from __future__ import annotations

import collections

import torch


class ExpertsBesideZero:
    """AdamW over `param_groups`: the parameters in `experts` (a set of ids) unsharded, the others through
    `sharded` (a callable building the sharded AdamW from param groups, `sharded_optimizer.sharded_adamw`)."""

    def __init__(self, param_groups: list[dict], experts: set[int], sharded, **adamw):
        self.param_groups = [{**group, "params": list(group["params"])} for group in param_groups]
        self.sharded = sharded(self._groups(lambda p: id(p) not in experts), **adamw)
        self.experts = torch.optim.AdamW(self._groups(lambda p: id(p) in experts), **adamw)
        self.param_groups = [{**inner, "params": group["params"]}  # the defaults AdamW added, once
                             for group, inner in zip(self.param_groups, self.experts.param_groups)]

    def _groups(self, keep) -> list[dict]:
        return [{**group, "params": [p for p in group["params"] if keep(p)]} for group in self.param_groups]

    def _parts(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return self.sharded, self.experts

    @property
    def state(self) -> collections.ChainMap:
        """Parameter -> its moments, for the parameters whose moments this rank keeps (its experts, its ZeRO share)."""
        return collections.ChainMap(self.experts.state, self.sharded.optim.state)

    @property
    def process_group(self):
        return self.sharded.process_group

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self._parts():
            part.zero_grad(set_to_none=set_to_none)

    def _set_hyperparameters(self) -> None:
        """The hyper-parameters of `param_groups` (the learning rate the trainer sets) in both optimizers' groups."""
        for part in self._parts():
            for group, inner in zip(self.param_groups, part.param_groups):
                inner.update({k: v for k, v in group.items() if k != "params"})

    def step(self, closure=None) -> None:
        self._set_hyperparameters()
        self.experts.step()
        self.sharded.step(closure)

    def consolidate_state_dict(self, to: int = 0) -> None:
        self.sharded.consolidate_state_dict(to)

    def _index(self, part: torch.optim.Optimizer) -> list[int]:
        """The index, in this optimizer's numbering, of each parameter of `part`'s (in `part`'s numbering)."""
        mine = {id(p): i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        return [mine[id(p)] for group in part.param_groups for p in group["params"]]

    def state_dict(self) -> dict:
        """What torch.optim.AdamW over `param_groups` returns: on the rank consolidate_state_dict named."""
        self._set_hyperparameters()
        state = {}
        for part in self._parts():
            index = self._index(part)
            state.update({index[i]: moments for i, moments in part.state_dict()["state"].items()})
        count, groups = 0, []
        for group in self.param_groups:
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(count, count + len(group["params"])))})
            count += len(group["params"])
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of an AdamW over `param_groups` (every parameter's moments, this rank's experts')."""
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for part in self._parts():
            index, saved_state = self._index(part), state_dict["state"]
            numbered = iter(range(len(index)))
            part.load_state_dict({
                "state": {i: saved_state[mine] for i, mine in enumerate(index) if mine in saved_state},
                "param_groups": [{**{k: v for k, v in saved.items() if k != "params"},
                                  "params": [next(numbered) for _ in group["params"]]}
                                 for saved, group in zip(state_dict["param_groups"], part.param_groups)]})
        self._set_hyperparameters()
