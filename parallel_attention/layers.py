"""Tensor-parallel linear and embedding layers.

Each layer builds the full weight from the default generator (seeded identically on every
rank by `manual_seed`) and keeps its shard, so a sharded model is exactly a slice of the
single-rank model whatever p is. Shapes: `s` sequence, `b` batch, `h` hidden, `p` TP size.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import mappings
from .grads import PartialGrad
from .parallel_state import ProcessGroup, group_rank, group_size, resolve_tp_group

InitMethod = Callable[[torch.Tensor], object]


def init_normal(std: float) -> InitMethod:
    """Normal(0, std) initialisation of a full weight, drawn from the default generator."""
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


def _divide(total: int, p: int, what: str) -> int:
    if total % p != 0:
        raise ValueError(
            f"{what}={total} is not divisible by tensor-parallel size {p}: "
            f"choose {what} as a multiple of {p} (or a tensor-parallel size that divides it)."
        )
    return total // p


def _shard_of_full(
    full_shape: tuple[int, int], dim: int, init_method: InitMethod | None,
    rank: int, p: int, device, dtype,
) -> torch.Tensor:
    """Build the full weight with `init_method`, return this rank's chunk along `dim`."""
    if init_method is None:  # the caller loads the weights (e.g. from a canonical state dict)
        shape = list(full_shape)
        shape[dim] //= p
        return torch.zeros(shape, device=device, dtype=dtype)
    full = torch.empty(full_shape, device=device, dtype=dtype)
    init_method(full)
    return full.chunk(p, dim=dim)[rank].clone()


class _TensorParallelModule(nn.Module):
    def _bind_group(self, tp_group: ProcessGroup | None) -> None:
        self.tp_group = resolve_tp_group(tp_group)
        self.tp_size = group_size(self.tp_group)
        self.tp_rank = group_rank(self.tp_group)


class ColumnParallelLinear(_TensorParallelModule):
    """Y = X A^T + b with A split by output rows (columns of A^T) across ranks.

        X [s, b, in]            (sequence_parallel: this rank's [s/p, b, in])
          | forward: identity   (SP: all-gather along s)
          | backward: all-reduce dX  (SP: reduce-scatter dX along s)
        Y_r = X A_r^T + b_r     A_r: [out/p, in], this rank's rows
          | gather_output: all-gather the last dim -> [s, b, out]
        Y_r [s, b, out/p]
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
        sequence_parallel: bool = False, init_method: InitMethod | None = init_normal(0.02),
        tp_group: ProcessGroup | None = None, device=None, dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self._bind_group(tp_group)
        if sequence_parallel and gather_output:
            raise ValueError(
                "ColumnParallelLinear: sequence_parallel=True with gather_output=True is not supported: "
                "keep the output split (gather_output=False) and feed a RowParallelLinear."
            )
        self.in_features, self.out_features = in_features, out_features
        self.out_features_per_rank = _divide(out_features, self.tp_size, "out_features")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight = nn.Parameter(_shard_of_full(
            (out_features, in_features), 0, init_method, self.tp_rank, self.tp_size, device, dtype))
        self.bias = (nn.Parameter(torch.zeros(self.out_features_per_rank, device=device, dtype=dtype))
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = mappings.copy_to_tensor_parallel_region(x, self.tp_group)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = mappings.gather_from_tensor_parallel_region(y, self.tp_group)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, out_per_rank={self.out_features_per_rank}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_TensorParallelModule):
    """Y = X A^T + b with A split by input columns across ranks; partial products are summed.

        X_r [s, b, in/p]        (input_is_parallel=False: X [s, b, in] is split here)
        Y_r = X_r A_r^T         A_r: [out, in/p], this rank's columns
          | forward: all-reduce the partials -> [s, b, out]
          |          (SP: reduce-scatter along s -> [s/p, b, out])
          | backward: identity  (SP: all-gather dY along s)
        Y = sum_r Y_r + b       b is replicated; under SP each rank sees only its tokens, so
                                finalize_grads() sums its gradient across the group
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = False,
        sequence_parallel: bool = False, init_method: InitMethod | None = init_normal(0.02),
        tp_group: ProcessGroup | None = None, device=None, dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self._bind_group(tp_group)
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True "
                "(its input comes split from a ColumnParallelLinear)."
            )
        self.in_features, self.out_features = in_features, out_features
        self.in_features_per_rank = _divide(in_features, self.tp_size, "in_features")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = nn.Parameter(_shard_of_full(
            (out_features, in_features), 1, init_method, self.tp_rank, self.tp_size, device, dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_parallel_region(x, self.tp_group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = mappings.reduce_from_tensor_parallel_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias

    def partial_grads(self) -> list[PartialGrad]:
        """Under sequence parallelism each rank's bias gradient covers only its own tokens."""
        if self.sequence_parallel and self.bias is not None:
            return [PartialGrad(self.bias, self.tp_group)]
        return []

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, in_per_rank={self.in_features_per_rank}, out={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(_TensorParallelModule):
    """Embedding table split by vocabulary rows; each rank looks up the tokens it owns.

        tokens [s, b]           every rank sees all tokens
        E_r [V/p, h]            rows r*V/p .. (r+1)*V/p - 1
          | tokens outside my range look up zeros
          | forward: all-reduce -> [s, b, h]  (SP: reduce-scatter along s -> [s/p, b, h])
          | backward: identity                (SP: all-gather along s)
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, init_method: InitMethod | None = init_normal(0.02),
        sequence_parallel: bool = False, tp_group: ProcessGroup | None = None, device=None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self._bind_group(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        self.num_embeddings_per_rank = _divide(num_embeddings, self.tp_size, "num_embeddings")
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.weight = nn.Parameter(_shard_of_full(
            (num_embeddings, embedding_dim), 0, init_method, self.tp_rank, self.tp_size, device, dtype))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return mappings.reduce_from_tensor_parallel_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, per_rank={self.num_embeddings_per_rank}, "
                f"embedding_dim={self.embedding_dim}, sequence_parallel={self.sequence_parallel}")
