"""Activation memory: the bytes autograd keeps for backward (Korthikanti et al. 2022's quantity).

`saved_activation_bytes(step_fn)` runs `step_fn()` under `torch.autograd.graph.saved_tensors_hooks`
and follows every tensor the forward saves for backward. A storage counts once however many ops
save it (or views of it) and for as long as one of them is still held; the result is the peak of
that live total over the forward passes of the step. Parameters (and views of them) are excluded:
they are weights, not activations. Tensors saved while a backward runs (the recomputation of
activation checkpointing) are not counted: the figure is what the forward keeps. A saved view counts
its whole storage: that is what it keeps alive.

`layer_activation_bytes(cfg, s, b, p, sp, granularity)` is the same quantity for one TransformerLayer,
from its terms (`layer_activation_terms`); tests/test_activation_memory.py holds the two equal.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..tensor_parallel.rng import manual_seed
from ..transformer.model import GPTModel
from ..transformer.model_config import ModelConfig


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


def _in_backward() -> bool:
    """Whether the autograd engine is running (recomputation inside backward saves tensors too). torch has
    no public call for it; without the private one, everything counts (recomputation included)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class _SavedBytes:
    """Live saved storages: key -> (bytes, number of saved references still held)."""

    def __init__(self) -> None:
        self.live: dict[tuple, list[int]] = {}
        self.total = 0
        self.peak = 0

    def hold(self, t: torch.Tensor) -> "_Held | torch.Tensor":
        if _is_parameter(t) or _in_backward() or t.device.type == "meta":
            return t
        storage = t.untyped_storage()
        key = (t.device.type, t.device.index, storage.data_ptr())
        entry = self.live.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.total += entry[0]
            self.peak = max(self.peak, self.total)
        entry[1] += 1
        return _Held(self, key, t)

    def release(self, key: tuple) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.total -= entry[0]
            del self.live[key]


class _Held:
    """What autograd keeps instead of the tensor: the tensor, and a release when autograd drops it."""

    __slots__ = ("owner", "key", "tensor")

    def __init__(self, owner: _SavedBytes, key: tuple, tensor: torch.Tensor) -> None:
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self) -> None:
        self.owner.release(self.key)


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Held) else packed


def saved_activation_bytes(step_fn: Callable[[], object]) -> int:
    """Peak bytes of the distinct storages that autograd holds for backward while `step_fn()` runs
    (each storage once, parameters excluded, the recomputation inside backward excluded).

    For a step_fn that runs one forward (and possibly its backward), this is what that forward saves.
    """
    counter = _SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(counter.hold, _unpack):
        step_fn()
    return counter.peak


def layer_activation_terms(cfg: ModelConfig, seq_len: int, batch: int, tp_size: int = 1,
                           sequence_parallel: bool = False) -> dict[str, int]:
    """What one TransformerLayer saves for backward without recomputation, term by term, in bytes, for float32
    weights and activations, the SDPA kernel without attention dropout and no hidden dropout (the defaults):
    each term is a tensor the layer's own code saves (derivation and the comparison with Korthikanti et al.
    2022 in docs/performance.md). s = seq_len, b = batch, n = the tokens a norm sees (s/p under SP)."""
    e, s, b, h, p = 4, seq_len, batch, cfg.hidden_size, tp_size
    attn = cfg.attention_config()
    nhl, nkvl = attn.per_rank_heads(p)
    d, f = attn.head_dim, cfg.resolved_ffn_hidden_size() // p
    n = s // p if sequence_parallel else s
    rms = cfg.norm == "rmsnorm"
    terms = {
        # each norm: LayerNorm its input, RMSNorm its normalised input (before the weight; norms.py)
        "norm inputs": 2 * e * n * b * h,
        "norm statistics (float32)": 2 * 4 * n * b * (1 if rms else 2),  # rstd; LayerNorm: mean and rstd
        # the column-parallel GEMMs keep their input: under SP this rank's [s/p, b, h] chunk, all-gathered again
        # in backward (Korthikanti et al. 2022)
        "qkv and fc_in inputs": 2 * e * n * b * h,
        "q, k, v": e * s * b * (nhl + 2 * nkvl) * d,  # views of the fused output, or rotated copies
        "rotary cos, sin": 2 * e * s * d if cfg.position_embedding == "rotary" else 0,
        "attention output (= dense input)": e * s * b * nhl * d,
        "attention logsumexp (float32)": 4 * b * nhl * s,
        # gelu: its input and output; swiglu: fc_in's [gate | up] output, silu(gate) and the product
        "mlp": e * s * b * f * (4 if cfg.activation == "swiglu" else 2),
    }
    return terms


def layer_activation_bytes(cfg: ModelConfig, seq_len: int, batch: int, tp_size: int = 1,
                           sequence_parallel: bool = False, granularity: str = "none") -> int:
    """Bytes one layer keeps for backward (see `layer_activation_terms`) under recomputation `granularity`:
    none; full (the layer's input only); selective (the attention core recomputed: its logsumexp goes, its
    output stays as the dense GEMM's input)."""
    terms = layer_activation_terms(cfg, seq_len, batch, tp_size, sequence_parallel)
    if granularity == "full":
        n = seq_len // tp_size if sequence_parallel else seq_len
        return 4 * n * batch * cfg.hidden_size
    if granularity == "selective":
        terms.pop("attention logsumexp (float32)")
    return sum(terms.values())


def measured_layer_bytes(cfg: ModelConfig, seq_len: int, batch: int, sequence_parallel: bool = False,
                         **model_kwargs) -> int:
    """Saved bytes of one transformer layer, measured: a 2-layer model's forward minus a 1-layer one's (the
    embedding, final norm and loss cancel), in this process's tensor-parallel group. model_kwargs go to GPTModel
    (cp_group=, context_parallel_kind=: the bytes of this rank's part of the sequence)."""
    saved = []
    for layers in (1, 2):
        manual_seed(0)
        model = GPTModel(ModelConfig(**{**cfg.__dict__, "num_layers": layers}), sequence_parallel=sequence_parallel,
                         **model_kwargs)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
        saved.append(saved_activation_bytes(lambda: model(tokens[:, :-1], tokens[:, 1:])))
    return saved[1] - saved[0]
