"""The device mesh of the job and its process groups: the one owner of both.

World = dp x tp, described by one `torch.distributed.device_mesh.DeviceMesh` with named dimensions
`MESH_DIMS` (tp innermost). With world size W and tensor-parallel size p, ranks [0..p-1], [p..2p-1], ...
form the tensor-parallel groups (consecutive ranks share a node, so the chatty TP collectives stay on
NVLink); ranks {i, i+p, i+2p, ...} form the data-parallel groups. A caller that has its own mesh hands
it to `initialize_model_parallel(mesh=...)`; `init_distributed` builds one otherwise. Without
torch.distributed initialised everything is a single rank: sizes are 1, ranks are 0 and groups are None.

Every `tp_group=` argument of the package takes a ProcessGroup or a 1-D DeviceMesh (`as_group`).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

ProcessGroup = dist.ProcessGroup

# outermost first; a context-parallel "cp" dimension goes between them (world = dp x cp x tp)
MESH_DIMS = ("dp", "tp")


@dataclass(frozen=True)
class _State:
    mesh: DeviceMesh
    groups: dict[str, ProcessGroup]  # this rank's group along each of MESH_DIMS
    timeout: datetime.timedelta | None


_STATE: _State | None = None
_EXIT_HANDLER_REGISTERED = False


def is_distributed() -> bool:
    """Whether torch.distributed is up (otherwise everything runs as a world of one)."""
    return dist.is_available() and dist.is_initialized()


def _as_timedelta(timeout) -> datetime.timedelta | None:
    return datetime.timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout


def _group_timeout(group: ProcessGroup | None) -> datetime.timedelta | None:
    """The timeout `group` (None: the world) was created with, or None where torch does not say."""
    try:  # private API; a torch without it says nothing
        from torch.distributed import distributed_c10d

        group = group if group is not None else distributed_c10d._get_default_group()
        device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        return group._get_backend(device).options._timeout
    except Exception:
        return None


def as_group(group: ProcessGroup | DeviceMesh | None) -> ProcessGroup | None:
    """A ProcessGroup as it is; a 1-D DeviceMesh as its group; None as None."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"a layer's group must be a ProcessGroup or a 1-D DeviceMesh, got a {group.ndim}-D mesh "
                             f"{group}: pass one dimension, e.g. mesh['tp'].")
        return group.get_group()
    return group


def _device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _build_mesh(sizes: dict[str, int], timeout) -> tuple[DeviceMesh, dict[str, ProcessGroup]]:
    """The mesh of `sizes` (MESH_DIMS order, consecutive ranks along the last) and this rank's group along each
    dimension, made with `timeout` (init_device_mesh would give its groups torch's 30-minute default instead)."""
    ranks = torch.arange(dist.get_world_size()).view(*sizes.values())
    groups = {}
    for dim, name in enumerate(sizes):
        for members in ranks.movedim(dim, -1).reshape(-1, sizes[name]).tolist():  # new_group: every rank, same order
            group = dist.new_group(members, timeout=timeout)
            if dist.get_rank() in members:
                groups[name] = group
    mesh = DeviceMesh.from_group([groups[n] for n in sizes], _device_type(), mesh=ranks, mesh_dim_names=tuple(sizes))
    return mesh, groups


def _adopt_mesh(mesh: DeviceMesh) -> dict[str, ProcessGroup]:
    names = mesh.mesh_dim_names or ()
    missing = [n for n in MESH_DIMS if n not in names]
    extra = [n for n in names if n not in MESH_DIMS]
    if missing or extra:
        raise ValueError(f"initialize_model_parallel(mesh=...): the mesh's dimensions are {names}; it needs exactly "
                         f"{MESH_DIMS} (outermost first): build it with init_device_mesh(device, shape, "
                         f"mesh_dim_names={MESH_DIMS}).")
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"initialize_model_parallel(mesh=...): the mesh holds {mesh.size()} ranks but the world has "
                         f"{dist.get_world_size()}: make the mesh over every rank.")
    return {name: mesh.get_group(name) for name in MESH_DIMS}


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              timeout: datetime.timedelta | float | None = None, *,
                              mesh: DeviceMesh | None = None) -> None:
    """Set up the job's mesh; call once after `init_process_group`, on every rank (group creation is collective).

    mesh=None: build a ("dp", "tp") mesh with tp = tensor_model_parallel_size, whose groups get `timeout`
    (default: the world group's). mesh=...: adopt the caller's DeviceMesh, whose dimensions are named
    ("dp", "tp"); its groups are used as they are.
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
        groups = _adopt_mesh(mesh)
        _STATE = _State(mesh, groups, _group_timeout(groups["tp"]))
    else:
        sizes = {"dp": _data_parallel_size(tensor_model_parallel_size), "tp": tensor_model_parallel_size}
        timeout = _as_timedelta(timeout) or _group_timeout(None)
        _STATE = _State(*_build_mesh(sizes, timeout), timeout)
    if not _EXIT_HANDLER_REGISTERED:
        # Forget the groups at the interpreter's exit where the caller destroyed only the process group: a gloo
        # group left to the C++ teardown can abort the process (SIGABRT, "terminate called without an active
        # exception"). Registered here, by the caller's own call, not at import; a no-op once the groups are gone.
        atexit.register(destroy_model_parallel)
        _EXIT_HANDLER_REGISTERED = True


def _data_parallel_size(p: int) -> int:
    world = dist.get_world_size()
    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        raise ValueError(f"tensor_model_parallel_size={p!r} must be a positive integer.")
    if world % p != 0:
        raise ValueError(
            f"world size {world} is not a multiple of tensor_model_parallel_size={p}: "
            f"launch a multiple of {p} processes or choose a tensor-parallel size that divides {world}."
        )
    return world // p


def describe_group(group: ProcessGroup | None) -> str:
    """"tensor-parallel group (global ranks [0, 1])", for error messages."""
    words = {"tp": "tensor-parallel", "dp": "data-parallel", "cp": "context-parallel"}
    if _STATE is not None:
        for name, mine in _STATE.groups.items():
            if group is mine:
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
    """The job's ("dp", "tp") DeviceMesh (the caller's, where it brought one); None before initialize_model_parallel."""
    return None if _STATE is None else _STATE.mesh


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


def init_distributed(
    tensor_model_parallel_size: int = 1,
    backend: str | None = None,
    timeout: datetime.timedelta | float = datetime.timedelta(minutes=10),
) -> torch.device:
    """Initialise torch.distributed from the torchrun environment, then the job's ("dp", "tp") mesh.

    Picks NCCL when CUDA is available and gloo otherwise (`backend=` overrides), binds this
    process to cuda:LOCAL_RANK, and returns the device the caller should put tensors on.
    Run without torchrun (no RANK/WORLD_SIZE in the environment) it starts a world of one.
    """
    timeout = _as_timedelta(timeout)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
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
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            kwargs = {"device_id": device} if backend == "nccl" else {}
            dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
        else:
            store = dist.HashStore()
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
    initialize_model_parallel(tensor_model_parallel_size, timeout=timeout)
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

