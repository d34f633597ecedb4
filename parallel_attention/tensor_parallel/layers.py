"""Tensor-parallel linear and embedding layers.

Each layer builds the full weight from the default generator (seeded identically on every
rank by `manual_seed`) and keeps its shard, so a sharded model is exactly a slice of the
single-rank model whatever p is. Each linear runs its GEMM and its collectives as one autograd function of
`linear_functions`, the variant (p = 1, tensor or sequence parallel, overlapped or not) chosen in `__init__`.
Shapes: `s` sequence, `b` batch, `h` hidden, `p` TP size.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from . import mappings
from . import linear_functions as fn
from .linear_functions import OVERLAP_COMM
from .linear_precision import FOLLOW_POLICY, HIGH_PRECISION
from .param_kinds import PartialGrad, Replicated, Sharded
from .parallel_state import ProcessGroup, group_rank, group_size, resolve_tp_group


def _divide(total: int, p: int, what: str) -> int:
    if total % p != 0:
        raise ValueError(
            f"{what}={total} is not divisible by tensor-parallel size {p}: "
            f"choose {what} as a multiple of {p} (or a tensor-parallel size that divides it)."
        )
    return total // p


def _shard_of_full(
    full_shape: tuple[int, int], dim: int, init_std: float | None, rank: int, p: int, device, dtype,
) -> torch.Tensor:
    """Draw the full weight from N(0, init_std^2) and keep this rank's chunk along `dim` (p-invariant).

    init_std=None: zeros, for an owner that loads the weights itself (from a canonical state dict).
    """
    if init_std is None:
        shape = list(full_shape)
        shape[dim] //= p
        return torch.zeros(shape, device=device, dtype=dtype)
    full = torch.empty(full_shape, device=device, dtype=dtype).normal_(0.0, init_std)
    return full.chunk(p, dim=dim)[rank].clone()


class _TensorParallelModule(nn.Module):
    def __init__(self, tp_group: ProcessGroup | None) -> None:
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group)
        self.tp_size = group_size(self.tp_group)
        self.tp_rank = group_rank(self.tp_group)

    def _init_weight(self, in_features: int, out_features: int, split_dim: int, init_std, device, dtype) -> None:
        """This rank's part of the full [out, in] weight, split along `split_dim`."""
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(_shard_of_full(
            (out_features, in_features), split_dim, init_std, self.tp_rank, self.tp_size, device, dtype))

    def _region(self, function):
        """`function` (a collective of `collectives`) bound to this layer's group."""
        return partial(function, group=self.tp_group)


class ColumnParallelLinear(_TensorParallelModule):
    """Y = X A^T + b with A split by output rows (columns of A^T) across ranks.

        X [s, b, in]            (sequence_parallel: this rank's [s/p, b, in])
          | forward: identity   (SP: all-gather along s)
          | backward: all-reduce dX  (SP: all-gather X again, reduce-scatter dX along s)
        Y_r = X A_r^T + b_r     A_r: [out/p, in], this rank's rows
          | gather_output: all-gather the last dim -> [s, b, out]
        Y_r [s, b, out/p]

    Under SP only this rank's [s/p, b, in] input is kept for backward (Korthikanti et al. 2022), gathered
    again while dX is computed. overlap_comm: the backward's collectives run while the next GEMM computes
    (dX's while dA, db are computed); the same collectives either way. It multiplies in the precision policy's
    precision (`linear_precision`: FP8 inside `fp8_linears`).
    """

    precision = FOLLOW_POLICY

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
        sequence_parallel: bool = False, init_std: float | None = 0.02,
        tp_group: ProcessGroup | None = None, device=None, dtype: torch.dtype = torch.float32,
        overlap_comm: bool = OVERLAP_COMM,
    ) -> None:
        super().__init__(tp_group)
        if sequence_parallel and gather_output:
            raise ValueError(
                "ColumnParallelLinear: sequence_parallel=True with gather_output=True is not supported: "
                "keep the output split (gather_output=False) and feed a RowParallelLinear."
            )
        self.out_features_per_rank = _divide(out_features, self.tp_size, "out_features")
        self.gather_output, self.sequence_parallel, self.overlap_comm = gather_output, sequence_parallel, overlap_comm
        self._init_weight(in_features, out_features, 0, init_std, device, dtype)
        self.bias = (nn.Parameter(torch.zeros(self.out_features_per_rank, device=device, dtype=dtype))
                     if bias else None)
        self.comm = column_communication(self.tp_group, self.tp_size, sequence_parallel, overlap_comm)
        self._exit = self._region(mappings.gather_from_tensor_parallel_region) if gather_output else unchanged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._exit(fn.column_parallel_linear(x, self.weight, self.bias, self.comm, self.precision))

    def parameter_kinds(self) -> dict:
        return {name: Sharded(0, self.tp_group) for name, _ in self.named_parameters(recurse=False)}

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, out_per_rank={self.out_features_per_rank}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}, overlap_comm={self.overlap_comm}")


class RowParallelLinear(_TensorParallelModule):
    """Y = X A^T + b with A split by input columns across ranks; partial products are summed.

        X_r [s, b, in/p]        (input_is_parallel=False: X [s, b, in] is split here)
        Y_r = X_r A_r^T         A_r: [out, in/p], this rank's columns
          | forward: all-reduce the partials -> [s, b, out]
          |          (SP: reduce-scatter along s -> [s/p, b, out])
          | backward: identity  (SP: all-gather dY along s)
        Y = sum_r Y_r + b       b is replicated; under SP each rank sees only its tokens, so
                                finalize_grads() sums its gradient across the group

    It multiplies in the precision policy's precision (`linear_precision`: FP8 inside `fp8_linears`).
    """

    precision = FOLLOW_POLICY

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = False,
                 sequence_parallel: bool = False, init_std: float | None = 0.02, tp_group: ProcessGroup | None = None,
                 device=None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(tp_group)
        self.in_features_per_rank = _divide(in_features, self.tp_size, "in_features")
        if sequence_parallel and not input_is_parallel:  # the reduce-scatter needs the ranks' partial sums
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True "
                             "(its input comes split from a ColumnParallelLinear).")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self._init_weight(in_features, out_features, 1, init_std, device, dtype)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self._enter = (unchanged if input_is_parallel
                       else self._region(mappings.scatter_to_tensor_parallel_region))
        # the GEMM and its exit collective fused (reduced in place); p = 1: no collective
        self.comm = row_communication(self.tp_group, self.tp_size, sequence_parallel)
        self._add_bias = self._plus_bias if bias else unchanged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_bias(fn.row_parallel_linear(self._enter(x), self.weight, self.comm, self.precision))

    def _plus_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y + self.bias

    def parameter_kinds(self) -> dict:
        """The bias is replicated; under sequence parallelism each rank's gradient covers only its tokens."""
        kinds = {"weight": Sharded(1, self.tp_group)}
        if self.bias is not None:
            kinds["bias"] = PartialGrad(self.tp_group) if self.sequence_parallel else Replicated(self.tp_group)
        return kinds

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
        self, num_embeddings: int, embedding_dim: int, init_std: float | None = 0.02,
        sequence_parallel: bool = False, tp_group: ProcessGroup | None = None, device=None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        self.num_embeddings_per_rank = _divide(num_embeddings, self.tp_size, "num_embeddings")
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.weight = nn.Parameter(_shard_of_full(
            (num_embeddings, embedding_dim), 0, init_std, self.tp_rank, self.tp_size, device, dtype))
        self._exit = self._region(mappings.reduce_scatter_to_sequence_parallel_region if sequence_parallel
                                  else mappings.reduce_from_tensor_parallel_region)

        self._lookup = self._lookup_my_rows if self.tp_size > 1 else self._lookup_all

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._exit(self._lookup(tokens))

    def _lookup_all(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)

    def _lookup_my_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows this rank owns; zeros for the other tokens (another rank adds them in the reduction)."""
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        return F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)

    def parameter_kinds(self) -> dict:
        return {"weight": Sharded(0, self.tp_group)}

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, per_rank={self.num_embeddings_per_rank}, "
                f"embedding_dim={self.embedding_dim}, sequence_parallel={self.sequence_parallel}")


class TiedOutputLayer(_TensorParallelModule):
    """Logits from a VocabParallelEmbedding's own table: a ColumnParallelLinear without a weight of its own.

        X [s, b, h]            (sequence_parallel: [s/p, b, h])
          | forward: identity  (SP: all-gather along s); backward: all-reduce (SP: reduce-scatter)
        Y_r = X E_r^T          E_r: [V/p, h], the embedding's rows on this rank
        Y_r [s, b, V/p]

    The embedding is held outside the module tree, so its weight appears once in state dicts. An output layer: it
    multiplies in high precision under FP8 too.
    """

    def __init__(self, embedding: VocabParallelEmbedding, sequence_parallel: bool = False,
                 overlap_comm: bool = OVERLAP_COMM) -> None:
        super().__init__(embedding.tp_group)
        self._embedding = [embedding]  # a list: not registered as a child module
        self.comm = column_communication(self.tp_group, self.tp_size, sequence_parallel, overlap_comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fn.column_parallel_linear(x, self._embedding[0].weight, None, self.comm, HIGH_PRECISION)


class OutputLinear(ColumnParallelLinear):
    """The output layer's own (untied) ColumnParallelLinear: it multiplies in high precision under FP8 too, as
    torchao's and Transformer Engine's recipes keep the logits' GEMM."""

    precision = HIGH_PRECISION


def column_communication(group, tp_size: int, sequence_parallel: bool, overlap_comm: bool) -> fn.LocalColumn:
    """What a column-parallel linear communicates, chosen once: nothing at p = 1; else the tensor- or
    sequence-parallel collectives, the backward waiting for each after its next GEMM (overlap_comm) or at once."""
    if tp_size == 1:
        return fn.LOCAL_COLUMN
    wait_policy = fn.wait_after_next_gemm if overlap_comm else fn.wait_at_once
    return (fn.SequenceParallelColumn if sequence_parallel else fn.TensorParallelColumn)(group, wait_policy)


def row_communication(group, tp_size: int, sequence_parallel: bool) -> fn.LocalRow:
    """What a row-parallel linear communicates, chosen once: nothing at p = 1; else the all-reduce or the
    reduce-scatter of its output."""
    if tp_size == 1:
        return fn.LOCAL_ROW
    return (fn.SequenceParallelRow if sequence_parallel else fn.TensorParallelRow)(group)


def unchanged(x: torch.Tensor) -> torch.Tensor:
    """x as it is: the variant chosen where there is nothing to apply (no region, bias, copy or dropout)."""
    return x
