"""Optimizer and RNG state as named tensors plus JSON metadata: what goes into optim_*/rng_* files.

`optimizer.state_dict()` refers to parameters by their position in the optimizer; the files key
them by parameter name instead (`exp_avg/<name>`), so a checkpoint does not depend on the order in
which parameters were handed to the optimizer and can be resharded by name. An optimizer whose state
is sharded across the data-parallel group (torch's ZeroRedundancyOptimizer API) is consolidated in
memory on the writing rank first, so its files are those of an unsharded one; loading hands every rank
the full state dict and the optimizer keeps its own partition. Under FSDP2 (zero_stage 3) the DTensor moments
are gathered over the data-parallel group (`gathered`) and cut again on load (`placed_like`). Generators are saved
as uint8 tensors and JSON, never pickled, so loading a checkpoint runs no code.
"""

from __future__ import annotations

import json
import random

import torch

from ..tensor_parallel import rng as tp_random
from ..tensor_parallel.collectives import full_tensor
from .format import CheckpointError
from .tensor_io import cpu_tensors

_GROUP_TENSOR = "__param_groups__"  # tensor-valued hyper-parameters: __param_groups__/<group>/<key>


def _live_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The parameter names of each param group, in the optimizer's order."""
    names = {id(p): name for name, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(f"the optimizer holds parameters of shapes {missing} that model.named_parameters() "
                             "does not list: pass the model the optimizer was built for.")
        groups.append([names[id(p)] for p in group["params"]])
    return groups


def full_optimizer_state(optimizer: torch.optim.Optimizer, writer: bool) -> dict | None:
    """optimizer.state_dict() on the writing rank (data-parallel rank 0), None elsewhere.

    A sharded optimizer (`consolidate_state_dict`, torch's ZeroRedundancyOptimizer API) gathers its shards
    on data-parallel rank 0 first, in memory: a collective over its group, so every rank must call this."""
    consolidate = getattr(optimizer, "consolidate_state_dict", None)
    if consolidate is not None:
        consolidate(to=0)
        return optimizer.state_dict() if writer else None
    packed = optimizer.state_dict()  # FSDP2 (zero_stage 3): DTensor moments, gathered over dp by every rank
    state = {i: gathered(per_param, writer) for i, per_param in sorted(packed["state"].items())}
    return {**packed, "state": state} if writer else None


def gathered(tensors: dict, writer: bool) -> dict:
    """`tensors` with each DTensor (FSDP2's data-parallel shards) replaced by its whole value, one at a time: a
    collective, so every rank calls it; only the writer keeps the gathered copies (the others get {})."""
    out = {}
    for name, value in tensors.items():
        whole = full_tensor(value) if isinstance(value, torch.Tensor) else value
        if writer:
            out[name] = whole
    return out


def placed_like(tensors: dict, current: dict) -> dict:
    """Whole tensors read from a file, each cut like the tensor of the same name in `current` where that one is a
    DTensor (FSDP2: this rank's data-parallel shard, no communication); the others as they are."""
    from torch.distributed.tensor import distribute_tensor

    def place(name, value):
        like = current.get(name)
        if getattr(like, "placements", None) is None or not isinstance(value, torch.Tensor) \
                or value.shape != like.shape:
            return value
        return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return {name: place(name, value) for name, value in tensors.items()}


def placed_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """An optimizer state dict of whole tensors with the moments of DTensor parameters cut like them."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {i: placed_like(values, {k: params[i] for k in values}) for i, values in state_dict["state"].items()}
    return {**state_dict, "state": state}


def _packed_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The `param_groups` of optimizer.state_dict(), without asking for it (a sharded optimizer has no full
    state_dict() outside a consolidation): hyper-parameters, and parameter indices numbered across the groups
    in order, as torch numbers them."""
    groups, start = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + count))})
        start += count
    return groups


def optim_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer, packed: dict) -> tuple[dict, dict]:
    """`packed` (optimizer.state_dict(), see full_optimizer_state) with parameter indices replaced by names;
    hyper-parameters as JSON."""
    live = _live_names(model, optimizer)
    name_of = {i: n for names, g in zip(live, packed["param_groups"]) for i, n in zip(g["params"], names)}
    tensors, scalars, groups = {}, {}, []
    for gi, (names, group) in enumerate(zip(live, packed["param_groups"])):
        hyper = {"params": names}
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_GROUP_TENSOR}/{gi}/{key}"] = value
            elif key not in ("params", "param_names"):
                hyper[key] = value
        groups.append(hyper)
    for index, state in packed["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{key}/{name_of[index]}"] = value
            else:
                scalars.setdefault(name_of[index], {})[key] = value
    return cpu_tensors(tensors), {"param_groups": json.dumps(groups), "scalar_state": json.dumps(scalars)}


def optim_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict, meta: dict) -> dict:
    """The inverse of `optim_tensors` for this optimizer's parameter indices; CheckpointError on mismatch."""
    saved_groups, scalars = json.loads(meta["param_groups"]), json.loads(meta["scalar_state"])
    live, packed = _live_names(model, optimizer), {"param_groups": _packed_groups(optimizer)}
    if len(saved_groups) != len(live):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one {len(live)}.")
    index_of, groups = {}, []
    for gi, (saved, names, group) in enumerate(zip(saved_groups, live, packed["param_groups"])):
        missing, unexpected = sorted(set(names) - set(saved["params"])), sorted(set(saved["params"]) - set(names))
        if missing or unexpected:
            raise CheckpointError(f"optimizer param group {gi}: parameters missing from the checkpoint {missing}, "
                                  f"in the checkpoint but not in this optimizer {unexpected}.")
        index_of.update(zip(names, group["params"]))
        restored = dict(group)
        for key, value in saved.items():
            if key != "params":  # JSON turned tuples (AdamW's betas) into lists
                restored[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        groups.append(restored)
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        kind, rest = key.split("/", 1)
        if kind == _GROUP_TENSOR:
            gi, hyper = rest.split("/", 1)
            groups[int(gi)][hyper] = value
        else:
            state.setdefault(index_of[rest], {})[kind] = value
    for name, values in scalars.items():
        state.setdefault(index_of[name], {}).update(values)
    return placed_optimizer_state(optimizer, {"state": state, "param_groups": groups})


def rng_tensors() -> tuple[dict, dict]:
    """This rank's generators as uint8 tensors (+ JSON metadata), no pickle: the default CPU one, the
    current CUDA device's (one device per rank; only if CUDA is in use, so saving never initialises it),
    the tensor-parallel ones, Python's `random` and NumPy's global state (data pipelines draw from them)."""
    tensors = {"torch/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["torch/cuda"] = torch.cuda.get_rng_state()
    for device_type, state in tp_random.get_tensor_parallel_rng_state().items():
        tensors[f"tensor_parallel/{device_type}"] = state
    version, internal, gauss = random.getstate()
    meta = {"python": json.dumps([version, list(internal), gauss])}
    try:
        import numpy as np
    except ImportError:
        return tensors, meta
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy/keys"] = torch.from_numpy(keys.astype("<u4").view(np.uint8).copy())
    meta["numpy"] = json.dumps([name, int(pos), int(has_gauss), float(cached)])
    return tensors, meta


def set_rng(tensors: dict, meta: dict) -> None:
    """The inverse of `rng_tensors`: restore this rank's generators."""
    torch.set_rng_state(tensors["torch/cpu"])
    if "torch/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch/cuda"])
    saved_tp = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("tensor_parallel/")}
    if saved_tp:
        tp_random.set_tensor_parallel_rng_state(saved_tp)
    version, internal, gauss = json.loads(meta["python"])
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in meta:
        import numpy as np
        name, pos, has_gauss, cached = json.loads(meta["numpy"])
        np.random.set_state((name, tensors["numpy/keys"].numpy().view("<u4").astype(np.uint32), pos, has_gauss, cached))


def merged_optimizer_meta(metas: list[dict]) -> dict:
    """The optimizer metadata of several pipeline stages' files as one: each param group's names in stage order (a
    tied embedding's copy once), every parameter's scalars (a file without metadata, a model file, gives {})."""
    metas = [m for m in metas if m and "param_groups" in m]
    if len(metas) <= 1:
        return metas[0] if metas else {}
    groups = [json.loads(m["param_groups"]) for m in metas]
    merged = [{**first, "params": list(dict.fromkeys(n for stage in stages for n in stage["params"]))}
              for first, stages in zip(groups[0], zip(*groups))]
    scalars = {k: v for m in metas for k, v in json.loads(m["scalar_state"]).items()}
    return {"param_groups": json.dumps(merged), "scalar_state": json.dumps(scalars)}


def optimizer_meta_for(meta: dict, live: set[str]) -> dict:
    """`meta` narrowed to the parameters this rank holds (a pipeline stage's, when resharding across stages)."""
    groups = [{**g, "params": [n for n in g["params"] if n in live]} for g in json.loads(meta["param_groups"])]
    scalars = {k: v for k, v in json.loads(meta["scalar_state"]).items() if k in live}
    return {"param_groups": json.dumps(groups), "scalar_state": json.dumps(scalars)}
