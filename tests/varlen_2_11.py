"""torch 2.11's varlen_attn, replayed inside the installed torch: a wrapper of 2.11's signature (window_size, no
enable_gqa, no head check) over custom operators of 2.11's schemas (`_varlen_attn` of 10 arguments, its backward of
14), with fake kernels of its shapes (out like the query, lse [heads, tokens] float32, a uint64 rng state [2]).
Written from the public signatures of torch/nn/attention/varlen.py at v2.11.0; the GPU image runs this torch.

`install(monkeypatch)` puts the wrapper where the library looks for varlen_attn; `FORWARD` and `BACKWARD` are the
operators it calls (their overload packets are named as torch's: `_varlen_attn`, `_varlen_attn_backward`).
"""

from __future__ import annotations

import torch

_NAMESPACE = "parallel_attention_tests_2_11"


@torch.library.custom_op(f"{_NAMESPACE}::_varlen_attn", mutates_args=())
def _varlen_attn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                 cu_seq_k: torch.Tensor, max_q: int, max_k: int, is_causal: bool = False, scale: float | None = None,
                 window_size: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise RuntimeError("the torch 2.11 stand-in has shapes only: run it under FakeTensorMode")


@_varlen_attn.register_fake
def _(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None):
    lse = torch.empty(query.shape[1], query.shape[0], dtype=torch.float32, device=query.device)
    return torch.empty_like(query), lse, torch.empty(2, dtype=torch.uint64, device=query.device)


@torch.library.custom_op(f"{_NAMESPACE}::_varlen_attn_backward", mutates_args=())
def _varlen_attn_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor,
                          max_q: int, max_k: int, is_causal: bool, rng_state: torch.Tensor,
                          scale: float | None = None, window_size: list[int] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise RuntimeError("the torch 2.11 stand-in has shapes only: run it under FakeTensorMode")


@_varlen_attn_backward.register_fake
def _(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state, scale=None,
      window_size=None):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


FORWARD = getattr(torch.ops, _NAMESPACE)._varlen_attn
BACKWARD = getattr(torch.ops, _NAMESPACE)._varlen_attn_backward


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    """2.11's public wrapper: causal is window (-1, 0); no head counts are checked."""
    out, lse, _ = FORWARD(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, tuple(window_size) == (-1, 0), scale,
                          list(window_size))
    return (out, lse) if return_aux is not None and return_aux.lse else out


def install(monkeypatch) -> None:
    """The library reads varlen_attn from torch.nn.attention.varlen: the 2.11 wrapper there, for this test."""
    import torch.nn.attention.varlen as installed

    monkeypatch.setattr(installed, "varlen_attn", varlen_attn)
