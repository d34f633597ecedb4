"""The device mesh of the job and its process groups: the one owner of both.

World = pp x dp x cp x tp, one `torch.distributed.device_mesh.DeviceMesh` with dimensions `MESH_DIMS` (tp
innermost, then cp, dp, pp outermost). With tensor-parallel size p and context-parallel size c, ranks [0..p-1],
[p..2p-1], ... form the tensor-parallel groups (consecutive ranks share a node: TP's collectives stay on NVLink);
ranks {i, i+p, ..., i+(c-1)p} the context-parallel groups; the same (pp, cp, tp) index the data-parallel groups;
the same (pp, tp) index the dp x cp group of gradient reduction (parameters are replicated across cp); the same
(dp, cp, tp) index the pipeline groups, whose first and last members form the embedding group (pp > 1). A caller
with its own mesh hands it to `initialize_model_parallel(mesh=...)`; `init_distributed` builds one otherwise.
Without torch.distributed everything is a single rank: sizes are 1, ranks are 0 and groups are None.

Every `tp_group=` argument of the package takes a ProcessGroup or a 1-D DeviceMesh (`as_group`).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .mesh_groups import (DP_CP, EMBEDDING, EXPERT, EXPERT_DATA, PP_LINKS, adopt_mesh, build_mesh, data_context_mesh,
                          data_parallel_size, group_timeout, nccl_diagnostics_env)

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class _State:
    mesh: DeviceMesh
    groups: dict[str, ProcessGroup | None]  # this rank's group along each of MESH_DIMS, and dp x cp (DP_CP)
    timeout: datetime.timedelta | None
    dp_cp_mesh: DeviceMesh | None = None  # 1-D, over groups[DP_CP] (`mesh_groups.data_context_mesh`)


_STATE: _State | None = None
_EXIT_HANDLER_REGISTERED = False


def is_distributed() -> bool:
    """Whether torch.distributed is up (otherwise everything runs as a world of one)."""
    return dist.is_available() and dist.is_initialized()


def _as_timedelta(timeout) -> datetime.timedelta | None:
    return datetime.timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout


def as_group(group: ProcessGroup | DeviceMesh | None) -> ProcessGroup | None:
    """A ProcessGroup as it is; a 1-D DeviceMesh as its group; None as None."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"a layer's group must be a ProcessGroup or a 1-D DeviceMesh, got a {group.ndim}-D mesh "
                             f"{group}: pass one dimension, e.g. mesh['tp'].")
        return group.get_group()
    return group


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              timeout: datetime.timedelta | float | None = None, *,
                              context_parallel_size: int = 1, mesh: DeviceMesh | None = None,
                              pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1) -> None:
    """Set up the job's mesh; call once after `init_process_group`, on every rank (group creation is collective).

    mesh=None: build a ("pp", "dp", "cp", "tp") mesh with tp = tensor_model_parallel_size, cp =
    context_parallel_size and pp = pipeline_model_parallel_size, whose groups get `timeout` (default: the world
    group's). mesh=...: adopt the caller's DeviceMesh, whose dimensions are named ("pp", "dp", "cp", "tp") or that
    without "pp" and/or "cp" (size 1); its groups are used as they are (the dp x cp group of gradient reduction and
    the embedding group are made from the mesh's ranks, with the tp group's timeout).
    expert_model_parallel_size (ep): MoE experts split over ep ranks of the dp x cp group, which ep divides.
    """
    global _STATE, _EXIT_HANDLER_REGISTERED
    if not is_distributed():
        raise RuntimeError(
            "initialize_model_parallel() needs torch.distributed to be initialised first: "
            "call torch.distributed.init_process_group(...) or parallel_attention.init_distributed()."
        )
    if _STATE is not None:
        raise RuntimeError("initialize_model_parallel() was already called; call destroy_model_parallel() first.")
    if mesh is not None:
        state = _State(mesh, *adopt_mesh(mesh, expert_model_parallel_size))
    else:
        cp, tp, pp = context_parallel_size, tensor_model_parallel_size, pipeline_model_parallel_size
        sizes = {"pp": pp, "dp": data_parallel_size(tp, cp, pp), "cp": cp, "tp": tp}
        timeout = _as_timedelta(timeout) or group_timeout(None)
        state = _State(*build_mesh(sizes, timeout, expert_model_parallel_size), timeout)
    _STATE = replace(state, dp_cp_mesh=data_context_mesh(state.mesh, state.groups))
    if not _EXIT_HANDLER_REGISTERED:
        # Forget the groups at the interpreter's exit where the caller destroyed only the process group: a gloo
        # group left to the C++ teardown can abort the process (SIGABRT, "terminate called without an active
        # exception"). Registered here, by the caller's own call, not at import; a no-op once the groups are gone.
        atexit.register(destroy_model_parallel)
        _EXIT_HANDLER_REGISTERED = True


def describe_group(group: ProcessGroup | None) -> str:
    """"tensor-parallel group (global ranks [0, 1])", for error messages."""
    words = {"tp": "tensor-parallel", "dp": "data-parallel", "cp": "context-parallel", "pp": "pipeline-parallel",
             DP_CP: "data x context-parallel", EMBEDDING: "tied-embedding (first and last stage)",
             **dict.fromkeys(PP_LINKS.values(), "pipeline link"), EXPERT: "expert-parallel",
             EXPERT_DATA: "same-expert"}
    if _STATE is not None:
        for name, mine in _STATE.groups.items():
            if mine is not None and group is mine:  # None: a group this layout lacks (pp 1's embedding), not the world
                return f"{words.get(name, name)} group (global ranks {dist.get_process_group_ranks(group)})"
    return "world group" if group is None else f"group of global ranks {dist.get_process_group_ranks(group)}"


def collective_timeout() -> datetime.timedelta | None:
    """The timeout of the mesh's groups (None: torch's default, or not known)."""
    return None if _STATE is None else _STATE.timeout


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Forget the mesh and its groups (the process group itself is left to `destroy_process_group`, to be called
    after this: while the groups are held here, their gloo threads outlive it; shutdown_distributed does both)."""
    global _STATE
    _STATE = None


def get_device_mesh() -> DeviceMesh | None:
    """The job's ("pp", "dp", "cp", "tp") DeviceMesh, or the caller's; None before initialize_model_parallel."""
    return None if _STATE is None else _STATE.mesh


def get_data_context_parallel_mesh() -> DeviceMesh | None:
    """A 1-D DeviceMesh over the dp x cp group (the mesh's "dp" dimension at cp = 1): what FSDP2 shards over at
    zero_stage 3, as DDP and ZeRO-1 reduce over that group; None before initialize_model_parallel."""
    return None if _STATE is None else _STATE.dp_cp_mesh


def _group(name: str) -> ProcessGroup | None:
    if _STATE is not None:
        return _STATE.groups[name]
    if is_distributed() and dist.get_world_size() > 1:
        raise RuntimeError(
            "torch.distributed is initialised with several ranks but initialize_model_parallel() "
            "was not called: call it, or pass tp_group= explicitly to the layer."
        )
    return None


def get_tensor_model_parallel_group() -> ProcessGroup | None:
    """The default tensor-parallel group; None when running as a single rank."""
    return _group("tp")


def get_data_parallel_group() -> ProcessGroup | None:
    return _group("dp")


def get_context_parallel_group() -> ProcessGroup | None:
    """The default context-parallel group (None at cp = 1 on an adopted ("dp", "tp") mesh, or a single rank)."""
    return _group("cp")


def get_data_context_parallel_group() -> ProcessGroup | None:
    """The dp x cp group (same tp rank) over which gradients of replicated-over-cp parameters are reduced."""
    return _group(DP_CP)


def get_pipeline_parallel_group() -> ProcessGroup | None:
    """The pipeline-parallel group: this rank's counterparts at the same (dp, cp, tp) index in every stage."""
    return _group("pp")


def get_pipeline_parallel_rank() -> int:
    """This rank's pipeline stage (0: the first; its size: group_size(get_pipeline_parallel_group()))."""
    return group_rank(get_pipeline_parallel_group())


def get_pipeline_links() -> dict[tuple[str, str], ProcessGroup] | None:
    """This rank's one-way pipeline links by (kind, end), as `mesh_groups.PP_LINKS` names them; None at pp = 1."""
    return {key: _group(name) for key, name in PP_LINKS.items()} if group_size(_group("pp")) > 1 else None


def get_embedding_group() -> ProcessGroup | None:
    """The first and last stage at this rank's (dp, cp, tp) index (tied embeddings); None at pp = 1 and on a
    middle stage."""
    return _group(EMBEDDING)


def get_expert_model_parallel_group() -> ProcessGroup | None:
    """ep ranks of this rank's dp x cp group, which split each MoE layer's experts (None at ep = 1)."""
    return _group(EXPERT)


def get_expert_data_parallel_group() -> ProcessGroup | None:
    """The dp x cp ranks that hold the same experts as this one (None at ep = 1)."""
    return _group(EXPERT_DATA)


def get_context_parallel_world_size() -> int:
    return group_size(get_context_parallel_group())


def get_context_parallel_rank() -> int:
    return group_rank(get_context_parallel_group())


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def get_tensor_model_parallel_world_size() -> int:
    return group_size(get_tensor_model_parallel_group())


def get_world_size() -> int:
    """The number of processes in the job (1 outside torch.distributed)."""
    return dist.get_world_size() if is_distributed() else 1


def get_global_rank() -> int:
    """This process's rank in the whole world (0 outside torch.distributed)."""
    return dist.get_rank() if is_distributed() else 0


def get_tensor_model_parallel_rank() -> int:
    return group_rank(get_tensor_model_parallel_group())


def get_data_parallel_world_size() -> int:
    return group_size(get_data_parallel_group())


def get_data_parallel_rank() -> int:
    return group_rank(get_data_parallel_group())


def resolve_tp_group(tp_group: ProcessGroup | DeviceMesh | None) -> ProcessGroup | None:
    """The one place a layer turns its `tp_group` argument (a group, a 1-D mesh, or None: the default) into the
    group it keeps."""
    return as_group(tp_group) if tp_group is not None else get_tensor_model_parallel_group()


def resolve_cp_group(cp_group: ProcessGroup | DeviceMesh | None) -> ProcessGroup | None:
    """As resolve_tp_group, for a layer's `cp_group` argument (None: the default context-parallel group, or no
    context parallelism when initialize_model_parallel was not called: a caller passing only tp_group= gets cp = 1)."""
    if cp_group is not None:
        return as_group(cp_group)
    return get_context_parallel_group() if _STATE is not None else None


def init_distributed(tensor_model_parallel_size: int = 1, backend: str | None = None,
                     timeout: datetime.timedelta | float = datetime.timedelta(minutes=10),
                     context_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                     expert_model_parallel_size: int = 1) -> torch.device:
    """Initialise torch.distributed from the torchrun environment, then the job's ("pp", "dp", "cp", "tp") mesh.

    Picks NCCL when CUDA is available and gloo otherwise (`backend=` overrides), binds this
    process to cuda:LOCAL_RANK, and returns the device the caller should put tensors on (NCCL's flight recorder on).
    Run without torchrun (no RANK/WORLD_SIZE in the environment) it starts a world of one.
    """
    timeout = _as_timedelta(timeout)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, which is not available here: use backend='gloo'.")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are visible: "
                "launch at most one process per GPU (--nproc-per-node)."
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    os.environ.update(nccl_diagnostics_env(backend, int(os.environ.get("WORLD_SIZE", "1")), os.environ))
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            kwargs = {"device_id": device} if backend == "nccl" else {}
            dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
        else:
            store = dist.HashStore()
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
    initialize_model_parallel(tensor_model_parallel_size, timeout=timeout, context_parallel_size=context_parallel_size,
                              pipeline_model_parallel_size=pipeline_model_parallel_size,
                              expert_model_parallel_size=expert_model_parallel_size)
    return device


def shutdown_distributed() -> None:
    """Undo init_distributed: forget the mesh, then destroy the process group where one is up.

    Scripts call it on every way out, errors included (a `finally`): a gloo group left to the interpreter's exit
    can abort the process ("terminate called without an active exception", SIGABRT) instead of letting it exit
    with the status it chose. Local on every rank: no collective, so a rank may call it alone.

    The garbage is collected first. torch's DistributedDataParallel sits in a reference cycle, so a DDP wrapper that
    its caller has dropped (its C++ reducer holds the data-parallel group and that group's gloo backend) lives on
    until the cyclic collector runs, which may be only during the interpreter's teardown, after the process group
    was destroyed. Collected here, that hold goes while the group is still intact. The caller drops its own
    references first (the scripts return from the function that built the run).
    """
    destroy_model_parallel()
    gc.collect()
    if is_distributed():
        dist.destroy_process_group()

