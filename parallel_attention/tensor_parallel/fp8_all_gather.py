"""FP8 all-gather under FSDP2 (zero_stage 3, tensorwise FP8): each FP8 linear's weight shard is cast to e4m3
before FSDP2 all-gathers it (a quarter of float32's bytes, half of bf16's), with the weight's global scale.

    shard    Fp8ShardedWeight: the master shard, float32 (optimizer, checkpoints and norms see only that)
      | fsdp_pre_all_gather: quantize(shard, s) in e4m3, sent as bytes (uint8: gloo and NCCL carry it)
      | FSDP2's all-gather over dp (x cp)
      | fsdp_post_all_gather
    gathered Fp8GatheredWeight: the whole e4m3 weight and s, read by the linear as it is (`GATHERED_IN_FP8`)

s = scale_for(amax) with the amax of the whole weight: the shards' amaxes MAX all-reduced over the FSDP group and
over the tensor-parallel group (the weight is split over both), once per step for every weight of a stage, in one
all-reduce per group (`Fp8WeightGather.refresh`, entered with the step's FP8 policy, after the optimizer step).
Quantizing is elementwise, so gathering the quantized shards equals quantizing the gathered weight: the numbers of
gathering in high precision and quantizing after, bit for bit.

torch's FSDP2 calls the two hooks on the local tensor of a parameter (torch/distributed/fsdp/_fully_shard/
_fsdp_param.py); both classes are wrapper subclasses holding a plain tensor. The shard answers every other op
with its plain tensor's result (so the optimizer, the norms and the checkpoint see float32), and keeps its class
through the ops FSDP2 uses to cut and pad it. The gathered weight is for the FP8 GEMMs only: any other use raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from .fp8 import E4M3, amax, quantize, scale_for
from .linear_precision import FOLLOW_POLICY, max_over
from .param_kinds import parameter_kinds

aten = torch.ops.aten
# ops whose results stay shards (FSDP2 cuts, pads and views the shard with them)
_SHARD_OPS = {aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
              aten.slice.Tensor, aten.as_strided.default, aten.new_zeros.default, aten.split.Tensor,
              aten.split_with_sizes.default}


def _wrapper(cls, like: torch.Tensor, dtype: torch.dtype):
    return torch.Tensor._make_wrapper_subclass(cls, like.size(), strides=like.stride(),
                                               storage_offset=like.storage_offset(), dtype=dtype, device=like.device)


class WeightScale:
    """The e4m3 scale of one weight, shared by its shard and the views FSDP2 makes of it; None until refreshed."""

    scale: torch.Tensor | None = None


class Fp8ShardedWeight(torch.Tensor):
    """A weight's FSDP2 shard in its own precision (`plain`), all-gathered in e4m3 with `box.scale`."""

    @staticmethod
    def __new__(cls, plain: torch.Tensor, box: WeightScale):
        return _wrapper(cls, plain, plain.dtype)

    def __init__(self, plain: torch.Tensor, box: WeightScale) -> None:
        self.plain, self.box = plain, box

    def __repr__(self) -> str:
        return f"Fp8ShardedWeight({self.plain!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        box = next(t.box for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls))
        plain_args, plain_kwargs = pytree.tree_map_only(cls, lambda t: t.plain, (args, kwargs or {}))
        out = func(*plain_args, **plain_kwargs)
        if func._schema.name.endswith("_") and isinstance(args[0], cls):  # in place: the shard itself
            return args[0]
        if func not in _SHARD_OPS:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, box), out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """(this shard in e4m3 as bytes, padded to FSDP2's even shard rows), (its scale)."""
        if self.box.scale is None:
            raise RuntimeError("FP8 all-gather of a weight whose scale was never computed: enter the step's FP8 "
                               "policy (training.precision.fp8_policy with the run's Fp8WeightGather) around "
                               "the forward, which computes the weights' global scales.")
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 pads every shard to the first one's rows
        data = quantize(self.plain, self.box.scale, E4M3).view(torch.uint8)
        data = F.pad(data, (0, 0) * (data.dim() - 1) + (0, rows - data.shape[0]))
        return (data,), (self.box.scale,)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered e4m3 weight with its scale (into `out`, FSDP2's unsharded parameter, after the first)."""
        (data,), (scale,) = outputs, metadata
        if out is not None:
            out.fp8_scale = scale  # FSDP2 gathers into the same storage every time; only the scale is new
            return None
        gathered = Fp8GatheredWeight(data.view(E4M3), scale, param_dtype)
        return gathered, (gathered.fp8_data,)


class Fp8GatheredWeight(torch.Tensor):
    """A whole weight in e4m3 (`fp8_data`) and its scale (`fp8_scale`), shaped and typed as the weight."""

    @staticmethod
    def __new__(cls, fp8_data: torch.Tensor, fp8_scale: torch.Tensor, dtype: torch.dtype):
        return _wrapper(cls, fp8_data, dtype)

    def __init__(self, fp8_data: torch.Tensor, fp8_scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.fp8_data, self.fp8_scale = fp8_data, fp8_scale

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight({list(self.shape)}, scale={self.fp8_scale.item()})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default, aten.as_strided.default, aten.view.default):
            weight = args[0]
            return cls(func(weight.fp8_data, *args[1:], **kwargs), weight.fp8_scale, weight.dtype)
        raise RuntimeError(f"{func} on a weight FSDP2 gathered in FP8 (zero_stage 3 with training.fp8="
                           "tensorwise): only the FP8 linears read it; run the model inside the step's FP8 policy.")


class GatheredInFp8:
    """The FP8 GEMMs' weights as FSDP2 gathered them: e4m3 with the step's global scale, used as they are."""

    scaled_in_linear = False  # refresh() reduced the amax over every group the weight is split over

    @staticmethod
    def amaxes(weight: Fp8GatheredWeight) -> tuple:
        return ()

    @staticmethod
    def scale(weight: Fp8GatheredWeight, amaxes: tuple) -> torch.Tensor:
        return weight.fp8_scale

    @staticmethod
    def quantized(weight: Fp8GatheredWeight, scale: torch.Tensor) -> torch.Tensor:
        return weight.fp8_data


GATHERED_IN_FP8 = GatheredInFp8()


class Fp8WeightGather:
    """The FP8 linears' weights of a model that FSDP2 gathers in e4m3, and their scales (`refresh`)."""

    def __init__(self, model: nn.Module, shard_group) -> None:
        """Make every FP8 linear's weight (a module declaring `precision = FOLLOW_POLICY`) an Fp8ShardedWeight;
        before `fully_shard`. `shard_group`: the group FSDP2 shards over."""
        kinds = parameter_kinds(model)
        self.shard_group, self.modules, tp_groups = shard_group, [], {}
        for name, module in model.named_modules():
            if getattr(module, "precision", None) is FOLLOW_POLICY:
                module.weight = nn.Parameter(Fp8ShardedWeight(module.weight.detach(), WeightScale()))
                group = kinds[f"{name}.weight" if name else "weight"][1].group  # the weight's tp split
                tp_groups.setdefault(id(group), (group, []))[1].append(len(self.modules))
                self.modules.append(module)
        self.tp_groups = list(tp_groups.values())  # (group, indices of its weights)

    @torch.no_grad()
    def refresh(self) -> GatheredInFp8:
        """Every weight's global scale from its current values: the shards' amaxes in one MAX all-reduce over
        the FSDP group, then one over each tensor-parallel group (one for a model's layers). Returns the GEMMs'
        weight policy."""
        shards = [module.weight.to_local() for module in self.modules]
        amaxes = list(max_over(self.shard_group, *(_shard_amax(shard) for shard in shards)))
        for group, indices in self.tp_groups:
            for i, reduced in zip(indices, max_over(group, *(amaxes[i] for i in indices))):
                amaxes[i] = reduced
        for shard, reduced in zip(shards, amaxes):
            shard.box.scale = scale_for(reduced, E4M3)
        return GATHERED_IN_FP8


def _shard_amax(shard: torch.Tensor) -> torch.Tensor:
    """A shard's amax; 0 for an empty one (FSDP2 cuts dim 0 into chunks of ceil(rows / ranks), so a rank may hold
    none: 3 rows over 4 ranks), which leaves the MAX over the group the other shards'."""
    return amax(shard, None) if shard.numel() else torch.zeros((), dtype=torch.float32, device=shard.device)
