"""`model.compile: true`: torch.compile (inductor) on each transformer layer, nothing else.

Per layer rather than the whole model: every layer has the same code and shapes, so one graph serves
them all (dynamo treats the parameters as inputs), compile time stays that of one layer, and activation
recompute keeps wrapping each (compiled) layer as before. The embedding, the output layer and the
vocab-parallel loss stay eager: they are one matmul and a few reductions, and the loss's collectives
would break the graph anyway. The tensor-parallel collectives inside a layer are autograd functions
that call torch.distributed; dynamo breaks the graph around them (docs/performance.md lists the breaks),
so each layer runs as a few compiled pieces with the collectives between them, in eager order.
"""

from __future__ import annotations

from torch import nn


def compile_layers(model: nn.Module) -> None:
    """Compile each of `model.layers` in place with inductor (module.compile keeps the state-dict keys)."""
    for layer in model.layers:
        layer.compile(backend="inductor", options={"fallback_random": True})
