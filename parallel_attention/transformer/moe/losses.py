"""The MoE layer's auxiliary losses, computed over all of a micro-batch's tokens wherever they live, and the way
their gradient joins the step's backward.

Per micro-batch, with T its counted tokens (those whose label is not ignored: counted_tokens.py), E experts, k per
token, c_i the counted tokens routed to expert i (kept by capacity or not) and P_i the mean routing probability
of expert i over the T tokens:

    load balancing  coeff * E * sum_i (c_i / (T k)) * P_i       (Switch Transformer / GShard form)
    z-loss          coeff * mean over tokens of logsumexp(logits)^2   (ST-MoE)

The ranks that hold parts of one micro-batch (the tensor-parallel ranks under sequence parallelism, the
context-parallel ranks) sum their counts, probability sums, token counts and z sums in one all-reduce per group
(with every token's counts, for the load the metrics show):
the value is the whole micro-batch's, never a shard's and never scaled by tp or cp. Each rank's gradient is
its own tokens' share (P_i's sum over its tokens, with c_i and T global), times cp where the language-model loss
is too (`ContextParallelPart.mean_loss`: averaged over dp x cp, that is the whole gradient).

The gradient joins the backward through `attach_aux_loss`: an identity on the layer's output whose backward
also starts the auxiliary loss's backward, scaled by the step's loss scale (1/micro-batches, the fp16 scale),
which `moe_step` sets. So the losses reach the router at every pipeline stage with no second backward and no
change to the loss the step sees; the values are recorded for the step's metrics.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ...tensor_parallel.collectives import all_reduce
from ...tensor_parallel.parallel_state import ProcessGroup, group_size
from .counted_tokens import AllTokens


@dataclass
class StepRecord:
    """What the MoE layers saw during one step: per layer, each micro-batch's losses and load."""

    loss_scale: float = 1.0
    rows: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> [aux, z, max/mean, dropped, shares]

    def add(self, layer: int, values: torch.Tensor) -> None:
        self.rows.setdefault(layer, []).append(values)

    def metrics(self, model_config, data_group: ProcessGroup | None = None,
                pipeline_group: ProcessGroup | None = None) -> dict[str, float]:
        """Each MoE layer's losses, max/mean load and (capacity mode) dropped share of slots, averaged over the step's
        micro-batches (those of every rank of `data_group`: each holds its own), gathered from every stage of
        `pipeline_group`; and the losses' sums over the layers. A collective over both groups when the model (its
        ModelConfig) has experts; {} without."""
        if model_config.num_experts == 0:
            return {}
        num_layers, experts = model_config.num_layers, model_config.num_experts
        # per layer: [aux, z, max/mean load, dropped share, each expert's share of the routed tokens..., micro-batches]
        values = torch.zeros(num_layers, 5 + experts, dtype=torch.float64)
        for layer, rows in self.rows.items():
            values[layer, :-1] = torch.stack(rows).double().sum(0).cpu()
            values[layer, -1] = len(rows)
        device = next((rows[0].device for rows in self.rows.values()), None)
        values = values.to(device) if device is not None else values
        for group in (data_group, pipeline_group):
            all_reduce(values, group)
        out = {}
        for layer in (i for i in range(num_layers) if values[i, -1] > 0):
            aux, z, load, dropped, *shares = (values[layer, :-1] / values[layer, -1]).tolist()
            out.update({f"moe_aux_loss/{layer}": aux, f"moe_z_loss/{layer}": z, f"moe_load/{layer}": load,
                        f"moe_expert_load/{layer}": [round(share, 6) for share in shares]})
            if model_config.moe_capacity_factor is not None:
                out[f"moe_dropped/{layer}"] = dropped
        if out:
            out["moe_aux_loss"] = sum(v for k, v in out.items() if k.startswith("moe_aux_loss/"))
            out["moe_z_loss"] = sum(v for k, v in out.items() if k.startswith("moe_z_loss/"))
        return out


_CURRENT = StepRecord()  # outside moe_step: scale 1 (a plain `loss.backward()` trains on loss + aux losses)


@contextlib.contextmanager
def moe_step(loss_scale: float = 1.0):
    """The context of one step's (or micro-batch's) forwards and backwards: the auxiliary losses' gradients are
    scaled by `loss_scale` (what the step multiplies its language-model loss by before backward: 1/micro-batches,
    times the fp16 loss scale), and the layers record their losses and loads into the StepRecord it yields. The
    balancing biases move once the step's update is known to apply (`update_expert_bias`, the trainer's)."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, StepRecord(float(loss_scale))
    try:
        yield _CURRENT
    finally:
        _CURRENT = previous


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: x unchanged. Backward: x's gradient as it came, and `scale` as the gradient of `loss` (so the
    auxiliary loss's own backward runs in the main one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def attach_aux_loss(x: torch.Tensor, loss: torch.Tensor, record: torch.Tensor, layer: int) -> torch.Tensor:
    """x, carrying `loss`'s gradient (scaled by the current step's loss scale); records `record`. MoE layers call
    it through `eager_attach_aux_loss()`."""
    _CURRENT.add(layer, record)
    return _AttachAuxLoss.apply(x, loss.float(), _CURRENT.loss_scale)


_EAGER_ATTACH = None  # attach_aux_loss under torch.compiler.disable, made by the first MoE layer


def eager_attach_aux_loss():
    """attach_aux_loss as torch.compile must run it: eagerly, between a compiled layer's pieces. Traced, it guarded
    on the step's record and loss scale, new each step, so every MoE layer recompiled at every step until dynamo's
    limit left it eager. Made on the first call, which each MoE layer's construction makes, before anything is
    traced (torch.compiler.disable imports torch._dynamo, which `import parallel_attention` leaves alone)."""
    global _EAGER_ATTACH
    if _EAGER_ATTACH is None:
        _EAGER_ATTACH = torch.compiler.disable(attach_aux_loss)
    return _EAGER_ATTACH


class RouterLosses:
    """Computes a layer's auxiliary losses from its routing over all tokens of the micro-batch.

    token_groups: the groups whose ranks hold other tokens of the same micro-batch (tp under sequence parallelism,
    cp); cp_size: the factor of the language-model loss's gradient convention."""

    def __init__(self, num_experts: int, top_k: int, aux_coeff: float, z_coeff: float,
                 token_groups: tuple[ProcessGroup | None, ...], cp_size: int) -> None:
        self.num_experts, self.top_k, self.aux_coeff, self.z_coeff = num_experts, top_k, aux_coeff, z_coeff
        self.token_groups = tuple(g for g in token_groups if group_size(g) > 1)
        self.cp_size = cp_size

    def __call__(self, logits: torch.Tensor, probabilities: torch.Tensor, expert_ids: torch.Tensor,
                 counts: torch.Tensor, counted: AllTokens,
                 dropped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's share of the losses, with gradient; the global [aux, z, max/mean load, dropped share, each
        expert's share of the routed tokens]).

        probabilities [T, E] summing to 1 per token; expert_ids [T, k]; counts [E] this rank's tokens per expert
        (float32); `counted`: the tokens the losses count (counted_tokens.py); `dropped`: capacity's share."""
        E = self.num_experts
        probability_sum = counted.sum(probabilities)
        z_sum = counted.sum(torch.logsumexp(logits, dim=-1).pow(2))
        dtype = probability_sum.dtype  # the router's: float32 or wider
        stats = torch.cat([counted.expert_counts(expert_ids, counts.to(dtype)), probability_sum.detach(),
                           counted.number(logits.shape[0], probability_sum), z_sum.detach().reshape(1),
                           counts.to(dtype)])
        for group in self.token_groups:
            all_reduce(stats, group)
        counted_counts, global_probability, tokens, global_z, global_counts = stats.split([E, E, 1, 1, E])
        tokens = tokens.clamp(min=1)  # a micro-batch with every label ignored: no loss (the sums are 0)
        fraction = counted_counts / (tokens * self.top_k)
        share = (self.aux_coeff * E / tokens) * (fraction * probability_sum).sum()
        share = share + (self.z_coeff / tokens) * z_sum
        aux = self.aux_coeff * E * (fraction * global_probability / tokens).sum()
        z = self.z_coeff * global_z / tokens
        load = global_counts.max() / global_counts.mean()
        record = torch.cat([torch.stack([aux, z.reshape(()), load, dropped.to(dtype)]),
                            global_counts / global_counts.sum()]).detach()
        return (share * self.cp_size).sum(), record
