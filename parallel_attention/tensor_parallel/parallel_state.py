"""Process groups for tensor parallelism (TP) and data parallelism (DP).

The one owner of the groups. With world size W and tensor-parallel size p, ranks
[0..p-1], [p..2p-1], ... form the tensor-parallel groups (consecutive ranks share a node,
so the chatty TP collectives stay on NVLink); ranks {i, i+p, i+2p, ...} form the
data-parallel groups. Without `torch.distributed` initialised everything is a single
rank: sizes are 1, ranks are 0 and groups are None.
"""

from __future__ import annotations

import atexit
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import shm_all_reduce

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class _Groups:
    tensor_parallel: ProcessGroup
    data_parallel: ProcessGroup
    tensor_parallel_ranks: tuple[int, ...]
    data_parallel_ranks: tuple[int, ...]
    timeout: datetime.timedelta | None


_GROUPS: _Groups | None = None


def is_distributed() -> bool:
    """Whether torch.distributed is up (otherwise everything runs as a world of one)."""
    return _is_distributed()


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _as_timedelta(timeout) -> datetime.timedelta | None:
    return datetime.timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout


def _world_timeout() -> datetime.timedelta | None:
    """The timeout the world group was created with, so the groups made here inherit it (without it
    torch gives new groups its 30-minute default, and a hung rank outlives the run's timeout)."""
    try:  # private API; a torch without it leaves torch's default
        from torch.distributed import distributed_c10d

        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return distributed_c10d._get_default_group()._get_backend(device).options._timeout
    except Exception:
        return None


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              timeout: datetime.timedelta | float | None = None) -> None:
    """Create the tensor- and data-parallel groups; call once after `init_process_group`.

    Every rank must call it (group creation is collective). `timeout` bounds every collective on
    the groups (default: the world group's timeout).
    """
    global _GROUPS
    if not _is_distributed():
        raise RuntimeError(
            "initialize_model_parallel() needs torch.distributed to be initialised first: "
            "call torch.distributed.init_process_group(...) or parallel_attention.init_distributed()."
        )
    if _GROUPS is not None:
        raise RuntimeError(
            "initialize_model_parallel() was already called; call destroy_model_parallel() first."
        )
    world = dist.get_world_size()
    p = tensor_model_parallel_size
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"tensor_model_parallel_size={p!r} must be a positive integer.")
    if world % p != 0:
        raise ValueError(
            f"world size {world} is not a multiple of tensor_model_parallel_size={p}: "
            f"launch a multiple of {p} processes or choose a tensor-parallel size that divides {world}."
        )
    timeout = _as_timedelta(timeout) or _world_timeout()
    tp_group, tp_ranks = _new_groups([tuple(range(start, start + p)) for start in range(0, world, p)], timeout)
    dp_group, dp_ranks = _new_groups([tuple(range(offset, world, p)) for offset in range(p)], timeout)
    _GROUPS = _Groups(tp_group, dp_group, tp_ranks, dp_ranks, timeout)


def _new_groups(all_ranks: list[tuple[int, ...]], timeout) -> tuple[ProcessGroup, tuple[int, ...]]:
    """Create every group of a kind (new_group is collective over the world: all ranks, same order);
    return this rank's group and its members."""
    mine = None
    for ranks in all_ranks:
        group = dist.new_group(list(ranks), timeout=timeout)
        if dist.get_rank() in ranks:
            mine = (group, ranks)
    return mine


def describe_group(group: ProcessGroup | None) -> str:
    """"the tensor-parallel group (ranks 0, 1)", for error messages."""
    if _GROUPS is not None and group is _GROUPS.tensor_parallel:
        return f"tensor-parallel group (global ranks {list(_GROUPS.tensor_parallel_ranks)})"
    if _GROUPS is not None and group is _GROUPS.data_parallel:
        return f"data-parallel group (global ranks {list(_GROUPS.data_parallel_ranks)})"
    return "world group" if group is None else f"group of global ranks {dist.get_process_group_ranks(group)}"


def collective_timeout() -> datetime.timedelta | None:
    """The timeout of the groups made by initialize_model_parallel (None: torch's default)."""
    return None if _GROUPS is None else _GROUPS.timeout


def model_parallel_is_initialized() -> bool:
    return _GROUPS is not None


def destroy_model_parallel() -> None:
    """Forget the groups and their shared-memory buffers (the process group itself is left to
    `destroy_process_group`, to be called after this: while the groups are held here, their gloo threads outlive
    it; shutdown_distributed does both)."""
    global _GROUPS
    _GROUPS = None
    shm_all_reduce.release_all()


# At the interpreter's exit, forget the groups still held here (a caller that destroyed the process group without
# destroy_model_parallel first). A gloo group that nothing else holds is then freed, and its threads joined, while
# the interpreter is whole; left to the C++ teardown, those threads can abort the process (SIGABRT, "terminate
# called without an active exception"). Registered at import, so it runs after the exit handlers registered
# later, which may still use the groups; destroy_model_parallel is a no-op where the groups are already gone.
atexit.register(destroy_model_parallel)


def get_tensor_model_parallel_group() -> ProcessGroup | None:
    """The default tensor-parallel group; None when running as a single rank."""
    if _GROUPS is not None:
        return _GROUPS.tensor_parallel
    if _is_distributed() and dist.get_world_size() > 1:
        raise RuntimeError(
            "torch.distributed is initialised with several ranks but initialize_model_parallel() "
            "was not called: call it, or pass tp_group= explicitly to the layer."
        )
    return None


def get_data_parallel_group() -> ProcessGroup | None:
    if _GROUPS is not None:
        return _GROUPS.data_parallel
    get_tensor_model_parallel_group()  # same error when misconfigured
    return None


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def get_tensor_model_parallel_world_size() -> int:
    return group_size(get_tensor_model_parallel_group())


def get_world_size() -> int:
    """The number of processes in the job (1 outside torch.distributed)."""
    return dist.get_world_size() if _is_distributed() else 1


def get_global_rank() -> int:
    """This process's rank in the whole world (0 outside torch.distributed)."""
    return dist.get_rank() if _is_distributed() else 0


def get_tensor_model_parallel_rank() -> int:
    return group_rank(get_tensor_model_parallel_group())


def get_data_parallel_world_size() -> int:
    return group_size(get_data_parallel_group())


def get_data_parallel_rank() -> int:
    return group_rank(get_data_parallel_group())


def resolve_tp_group(tp_group: ProcessGroup | None) -> ProcessGroup | None:
    """The one place a layer turns its `tp_group` argument into the group it keeps."""
    return tp_group if tp_group is not None else get_tensor_model_parallel_group()


def init_distributed(
    tensor_model_parallel_size: int = 1,
    backend: str | None = None,
    timeout: datetime.timedelta | float = datetime.timedelta(minutes=10),
) -> torch.device:
    """Initialise torch.distributed from the torchrun environment, then the model-parallel groups.

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
    """Undo init_distributed: forget the groups, then destroy the process group where one is up.

    Scripts call it on every way out, errors included (a `finally`): a gloo group left to the interpreter's exit
    can abort the process ("terminate called without an active exception", SIGABRT) instead of letting it exit
    with the status it chose. Local on every rank: no collective, so a rank may call it alone.
    """
    destroy_model_parallel()
    if _is_distributed():
        dist.destroy_process_group()
