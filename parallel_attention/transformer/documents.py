"""Packed documents: the per-batch `DocumentLayout`, built once per batch from `document_ids` and handed to
every layer's attention (never recomputed per layer).

    document_ids [b, s]  integers; the tokens of a row with equal ids form one document, and a document is
                         contiguous in its row (ids 7 7 3 3 3 9: three documents; 7 7 3 7: refused)
      | DocumentLayout.from_ids (validates, one host sync for the spans)
    segments   [b, s]  nondecreasing per row: 0 for the row's first document, 1 for its second, ...
    positions  [b, s]  restarted positions: 0 at each document's first token (rotary and learned positions)
    starts, ends [b, s] the global index of each token's document start, and its end (exclusive)
    spans(row)          ((start, end), ...) of the row's documents, Python ints: for per-document kernels
    cu_seqlens [n + 1]  int32 on the layout's device: where each of the batch's n documents starts in the batch
                        packed token-major ([b s]), then b s; max_length the longest (varlen kernels)

Contract for a kernel that works on blocks (the CPU per-document kernel here, the context-parallel ring):
- `row_groups()`: the rows a per-document kernel runs together (all of them when every row holds the same
  documents, else one at a time) with their spans: the one row loop of every per-document kernel.
- `block_pieces(q0, k0, m, causal)`: the per-document sub-pairs (`Piece`s) of the block of queries [q0, q0 + m)
  and keys [k0, k0 + m) (contiguous GLOBAL ranges, such as the ring's chunks); none when no query of the block may
  attend any key of it in any row (same document and, with `causal`, key index <= query index): the pair can be
  skipped.
  From the host-side spans: no tensor operation and no host sync, kept per block for the batch.
- `mask(q_index, k_index, causal)` is the bool [b, 1, sq, sk] mask of a block of GLOBAL token indices (1-D int64
  tensors on the layout's device, any order: a zigzag part is two ranges; True = may attend), to AND with a user's
  mask or for a kernel that reads masks; `full_mask(causal)` is that mask over the whole sequence, built once per
  layout and kept.
A query row whose every key is hidden outputs zeros (as in every backend); with causal attention inside
documents there is none, since each token sees itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


def _first_repeat(row_ids: torch.Tensor, run_starts: torch.Tensor) -> int | None:
    """Position of the first run whose id already occurred in an earlier run of the row, else None."""
    values = row_ids[run_starts]
    order = torch.sort(values, stable=True).indices
    repeats = order[1:][values[order][1:] == values[order][:-1]]  # later occurrences: the stable sort keeps order
    return None if repeats.numel() == 0 else int(run_starts[repeats.min()])


def check_document_ids(document_ids: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    """ValueError unless `document_ids` is an integer [b, s] tensor (of `shape`, when given) whose documents
    are contiguous in each row; the message names the row and the position."""
    if not isinstance(document_ids, torch.Tensor) or document_ids.dtype.is_floating_point \
            or document_ids.dtype.is_complex or document_ids.dtype == torch.bool:
        raise ValueError(f"document_ids must be an integer tensor [b, s], got "
                         f"{getattr(document_ids, 'dtype', type(document_ids).__name__)}.")
    if document_ids.dim() != 2 or (shape is not None and tuple(document_ids.shape) != tuple(shape)):
        want = f" = {list(shape)}, the tokens' shape" if shape is not None else ""
        raise ValueError(f"document_ids must be [b, s]{want}, got shape {tuple(document_ids.shape)}.")
    ids = document_ids.cpu()
    new_run = torch.ones_like(ids, dtype=torch.bool)
    new_run[:, 1:] = ids[:, 1:] != ids[:, :-1]
    for row in range(ids.shape[0]):
        position = _first_repeat(ids[row], new_run[row].nonzero().flatten())
        if position is not None:
            raise ValueError(
                f"document_ids row {row}: document {int(ids[row, position])} resumes at position {position} after "
                "another document: a document's tokens must be contiguous in its row (give each piece its own id).")


class Piece(NamedTuple):
    """One call of a kernel that runs attention piece by piece (kernels/flash_ops.FlashOps.forward_pieces):
    queries [q0, q1) of the batch rows `rows` against keys [k0, k1), indices into the tensors the kernel is handed;
    `causal`: the kernel's own causal mask, top-left on the square piece (query q0 + i sees keys k0 .. k0 + i);
    `mask`: an additive [q1 - q0, k1 - k0] mask, or None. Every other key of the piece is visible."""

    rows: slice
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    mask: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class DocumentLayout:
    """The documents of one batch (see the module docstring for the contract). Build with `from_ids`."""

    segments: torch.Tensor  # [b, s] int64, nondecreasing per row
    positions: torch.Tensor  # [b, s] int64, 0 at each document's first token
    starts: torch.Tensor  # [b, s] int64, global index of the token's document start
    ends: torch.Tensor  # [b, s] int64, global index one past the token's document end
    row_spans: tuple[tuple[tuple[int, int], ...], ...]  # per row: the (start, end) of each document
    cu_seqlens: torch.Tensor  # [n + 1] int32: document starts in the token-major packed batch, then b s
    max_length: int  # the longest document
    _kept: dict = field(default_factory=dict, repr=False)  # full_mask(causal) and block_pieces, kept once built

    @classmethod
    def from_ids(cls, document_ids: torch.Tensor, shape: tuple[int, ...] | None = None) -> DocumentLayout:
        """The layout of integer `document_ids` [b, s] (of `shape`, when given; validated: ValueError naming the
        row and position)."""
        check_document_ids(document_ids, shape)
        b, s = document_ids.shape
        index = torch.arange(s, device=document_ids.device).expand(b, s)
        first = torch.ones(b, s, dtype=torch.bool, device=document_ids.device)
        first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        last = torch.ones_like(first)
        last[:, :-1] = first[:, 1:]
        starts = torch.where(first, index, 0).cummax(dim=1).values
        ends = torch.where(last, index + 1, s).flip(1).cummin(dim=1).values.flip(1)
        segments = first.long().cumsum(dim=1) - 1
        firsts, lasts = first.cpu(), last.cpu()
        spans = tuple(tuple(zip(firsts[r].nonzero().flatten().tolist(), (lasts[r].nonzero().flatten() + 1).tolist()))
                      for r in range(b))
        packed = [r * s + start for r, row in enumerate(spans) for start, _ in row] + [b * s]
        cu_seqlens = torch.tensor(packed, dtype=torch.int32, device=document_ids.device)
        longest = max(end - start for row in spans for start, end in row)
        return cls(segments, index - starts, starts, ends, spans, cu_seqlens, longest)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.segments.shape)

    def spans(self, row: int) -> tuple[tuple[int, int], ...]:
        """(start, end) of each document of `row`, in order; they tile [0, s)."""
        return self.row_spans[row]

    def uniform(self) -> bool:
        """Whether every row holds the same documents (a per-document kernel can then run all rows at once)."""
        return all(spans == self.row_spans[0] for spans in self.row_spans)

    def row_groups(self) -> tuple[tuple[slice, tuple[tuple[int, int], ...]], ...]:
        """(rows, spans) for a per-document kernel: rows a slice of the batch, all rows at once when they hold the
        same documents (`uniform`), else one row at a time; spans the (start, end) of those rows' documents."""
        if self.uniform():
            return ((slice(None), self.row_spans[0]),)
        return tuple((slice(r, r + 1), spans) for r, spans in enumerate(self.row_spans))

    def mask(self, q_index: torch.Tensor, k_index: torch.Tensor, causal: bool) -> torch.Tensor:
        """Bool [b, 1, sq, sk]: True where query q_index[i] may attend key k_index[j] (same document, and with
        `causal` k_index[j] <= q_index[i])."""
        visible = self.segments[:, q_index].unsqueeze(-1) == self.segments[:, k_index].unsqueeze(-2)
        if causal:
            visible = visible & (k_index.unsqueeze(0) <= q_index.unsqueeze(1))
        return visible.unsqueeze(1)

    def block_pieces(self, q0: int, k0: int, m: int, causal: bool) -> tuple:
        """The per-document sub-pairs of the block of queries [q0, q0 + m) and keys [k0, k0 + m) (contiguous
        GLOBAL ranges): `Piece`s with their query and key ranges relative to q0 and k0, rows a slice of the batch
        (`row_groups`). Each is fully visible, or with `causal` the causal (top-left) square; every other
        (query, key) of the block is hidden. A query lies in at most one piece per row. No piece: the block is
        hidden. From the host-side spans (no tensor operation, no sync), built once per block and kept for the
        batch's other layers and the backward."""
        key = ("pieces", q0, k0, m, causal)
        if key not in self._kept:
            self._kept[key] = self._block_pieces(q0, k0, m, causal)
        return self._kept[key]

    def _block_pieces(self, q0: int, k0: int, m: int, causal: bool) -> tuple:
        if causal and k0 > q0:
            return ()
        pieces = []
        for row, spans in self.row_groups():
            for start, end in spans:
                qa, qb, ka, kb = max(start, q0), min(end, q0 + m), max(start, k0), min(end, k0 + m)
                if qa < qb and ka < kb:
                    pieces.append(Piece(row, qa - q0, qb - q0, ka - k0, kb - k0, causal and k0 == q0))
        return tuple(pieces)

    def full_mask(self, causal: bool) -> torch.Tensor:
        """mask() over the whole sequence, built on first use and kept for the batch's other layers."""
        if causal not in self._kept:
            index = torch.arange(self.shape[1], device=self.segments.device)
            self._kept[causal] = self.mask(index, index, causal)
        return self._kept[causal]

    def combine(self, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """The user's mask (broadcastable to [b, 1, s, s]) AND the documents' (AND causal)."""
        documents = self.full_mask(causal)
        return documents if mask is None else mask & documents


def positions_of(documents: DocumentLayout | None, position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The positions attention applies: the caller's, else the documents' restarted ones, else None (the default)."""
    if position_ids is not None or documents is None:
        return position_ids
    return documents.positions


def mask_cross_document_labels(labels: torch.Tensor, next_document_ids: torch.Tensor,
                               document_ids: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """labels [b, s] with `ignore_index` where the label's token (of document `next_document_ids`) starts another
    document than the input token's (`document_ids`): a packed batch does not predict across a boundary."""
    return labels.masked_fill(next_document_ids != document_ids, ignore_index)
