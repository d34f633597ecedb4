"""The two baselines of benchmarks/benchmark_attention.py, and the collective counter they share.

`PlainAttention` is the unsharded reference: plain nn.Linear q/k/v/o projections and SDPA,
the same math and the same [s, b, h] layout as ParallelSelfAttention, so that the two differ
only in how they are parallelised. `torch_tp` shards a copy of it with PyTorch's own tensor
parallelism (DTensor), the torchtitan way. Shapes: s sequence, b batch, h hidden, p TP size,
nh heads, nkv k/v heads, d head dim.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module


class PlainAttention(nn.Module):
    """x [s, b, h] -> q_proj/k_proj/v_proj -> causal SDPA (GQA) -> o_proj -> [s, b, h].

    The number of heads is read from the projection outputs (`view(..., -1, d)`), so the same
    forward runs unsharded (nh heads) and under torch TP (nh/p local heads).
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, device, dtype,
                 bias: bool = True) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype, bias=bias)
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, **kw)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, **kw)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, d = x.shape[0], x.shape[1], self.head_dim
        q, k, v = (proj(x).view(s, b, -1, d).permute(1, 2, 0, 3)  # [b, heads, s, d]
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.o_proj(context.permute(2, 0, 1, 3).reshape(s, b, -1))


def torch_tp(module: PlainAttention, device_type: str, world: int) -> nn.Module:
    """Shard `module` in place: q/k/v colwise (by heads), o_proj rowwise, over a 1-D mesh.

    The root's input is made a replicated DTensor once (PrepareModuleInput), as torchtitan does
    for its attention block: the three projections then sum their input gradients as one
    Partial DTensor and all-reduce it once, instead of once per projection.
    """
    mesh = init_device_mesh(device_type, (world,))
    plan = {"": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                   use_local_output=False),
            "q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
            "o_proj": RowwiseParallel()}
    return parallelize_module(module, mesh, plan)


# Collectives as called in Python: c10d (what parallel_attention.tensor_parallel.collectives calls) and the functional
# collectives DTensor redistributes with. Each maps to its payload in bytes, from (args, world size):
# the full buffer, i.e. the all-reduced tensor, the gathered output, the reduce-scattered input.
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_C10D = {"all_reduce": lambda a, p: _nbytes(a[0]),
         "all_gather_into_tensor": lambda a, p: _nbytes(a[0]),
         "all_gather_single": lambda a, p: _nbytes(a[0]),
         "reduce_scatter_tensor": lambda a, p: _nbytes(a[1]),
         "reduce_scatter_single": lambda a, p: _nbytes(a[1]),
         "all_to_all_single": lambda a, p: _nbytes(a[1]),
         "all_gather": lambda a, p: sum(_nbytes(t) for t in a[0]),
         "reduce_scatter": lambda a, p: sum(_nbytes(t) for t in a[1]),
         "broadcast": lambda a, p: _nbytes(a[0])}
_FUNCOL = {"all_reduce": lambda a, p: _nbytes(a[0]),
           "all_gather_tensor": lambda a, p: _nbytes(a[0]) * p,
           "all_gather_single": lambda a, p: _nbytes(a[0]) * p,
           "reduce_scatter_tensor": lambda a, p: _nbytes(a[0]),
           "reduce_scatter_single": lambda a, p: _nbytes(a[0]),
           "all_to_all_single": lambda a, p: _nbytes(a[0]),
           "broadcast": lambda a, p: _nbytes(a[0])}


class CollectiveCounter:
    """Counts collectives and their payload while active, by wrapping the Python entry points.

    Inside `with counter.counting():` torch.distributed.* and the functional collectives are
    patched; `counter.calls` lists (name, bytes) per call. Call sites that look the function up
    at call time (`dist.all_reduce(...)`, `funcol.all_reduce(...)`) are all caught; a wrapped
    function that calls another (torch 2.13's deprecated all_gather_into_tensor calls
    all_gather_single) counts once.
    """

    def __init__(self, world: int) -> None:
        self.world, self.calls, self._depth = world, [], 0

    def _wrap(self, module, name, size):
        original = getattr(module, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if self._depth == 0:
                self.calls.append((f"{module.__name__.rsplit('.', 1)[-1]}.{name}", size(args, self.world)))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
        return original, wrapper

    @contextlib.contextmanager
    def counting(self):
        self.calls = []
        patches = [(dist, n, f) for n, f in _C10D.items()] + [(funcol, n, f) for n, f in _FUNCOL.items()]
        saved = []
        try:
            for module, name, size in patches:
                if not hasattr(module, name):  # older torch: fewer entry points
                    continue
                original, wrapper = self._wrap(module, name, size)
                saved.append((module, name, original))
                setattr(module, name, wrapper)
            yield self
        finally:
            for module, name, original in saved:
                setattr(module, name, original)
