"""Which part of the model a pipeline stage's module holds, and how its parts get the same weights at any layout.

A model of L layers is cut into V = pp x v contiguous "virtual stages" (v model chunks per pipeline rank under the
interleaved schedule): chunk c of pipeline rank r is virtual stage c pp + r (Megatron's interleaving). The first
virtual stage also holds the embedding, the last the final norm, the output layer and the loss; with tied
embeddings the last holds a copy of the embedding table too, whose gradient is summed with the first stage's.

Layers keep their global index everywhere: a stage's `layers` are named `layers.<global index>` (state dicts and
checkpoints read the same at any split), and each layer is built with its global index (layout-invariant dropout
hashes it).

Weights: each part of the model (token table, positions, layer i, output layer) draws its initial values from a
generator seeded for that part alone (`seeded_part`), from a base drawn once from the default generator; so a
stage that builds only layers 5..7 draws for them exactly what one process building the whole model draws.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class PipelineStage:
    """The layers a pipeline rank holds, as one [first, stop) range per model chunk (v chunks under the interleaved
    schedule), with the embedding before chunk 0 (`has_embedding`) and/or the output layer and loss after the last
    chunk (`has_head`). The default is the whole model as one chunk."""

    chunks: tuple[tuple[int, int], ...] | None = None  # None: (0, num_layers)
    has_embedding: bool = True
    has_head: bool = True

    def layer_ranges(self, num_layers: int) -> list[range]:
        ranges = [range(first, stop) for first, stop in (self.chunks or ((0, num_layers),))]
        if not all(0 <= r.start < r.stop <= num_layers for r in ranges):
            raise ValueError(f"PipelineStage chunks {self.chunks} are not non-empty ranges inside the model's "
                             f"{num_layers} layers.")
        return ranges

    def describe(self) -> str:
        ranges = ", ".join(f"{first}-{stop - 1}" for first, stop in self.chunks or ())
        return (f"layers {ranges or 'all'}" + (" + embedding" if self.has_embedding else "")
                + (" + output layer and loss" if self.has_head else ""))


class StageLayers(nn.ModuleList):
    """The layers a stage holds, registered under their global indices (`layers.5.attention...`); iterated and
    indexed in order like a ModuleList."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        nn.Module.__init__(self)
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def __getitem__(self, position):
        return list(self._modules.values())[position]

    def global_indices(self) -> list[int]:
        return [int(name) for name in self._modules]


def chunk_parameters(model: nn.Module) -> list[list[nn.Parameter]]:
    """The parameters each chunk of a GPTModel's stage accumulates gradients into, in registration order: its
    layers, the embedding with the chunk that embeds, the rest (final norm, output layer, the tied table's copy)
    with the last chunk. Each parameter once (a whole model: one chunk holding all)."""
    by_index = dict(zip(model.layers.global_indices(), model.layers))
    chunks = [[p for i in r for p in by_index[i].parameters()] for r in model.stage.layer_ranges(model.config.num_layers)]
    if model.stage.has_embedding:
        chunks[0][:0] = [*model.embed_tokens.parameters(), *([model.embed_positions] if model.embed_positions is not
                                                             None else [])]
    placed = {id(p) for chunk in chunks for p in chunk}
    chunks[-1] += [p for p in model.parameters() if id(p) not in placed]
    return chunks


class PartSeeds:
    """Seeds of the model's parts: one base drawn from the default generator (the same draw at any layout), then
    part k's initial values come from a generator seeded base + k, inside `seeded(k)` (the default generators'
    states are restored afterwards)."""

    TOKEN_TABLE, POSITIONS, OUTPUT_LAYER, FIRST_LAYER = 0, 1, 2, 3

    def __init__(self, device) -> None:
        self.base = int(torch.randint(0, 2**62, (1,)).item())
        self.device = torch.device(device if device is not None else "cpu")

    @contextlib.contextmanager
    def seeded(self, part: int):
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.base + part)
            yield
