"""How the job's mesh and its groups are made: built from sizes, or adopted from the caller's DeviceMesh.

Pure construction, no state: parallel_state keeps what these return. Shapes: the rank grid is [pp, dp, cp, tp]
(tp innermost, consecutive ranks; pp outermost, so that a stage's tensor-parallel group stays inside a node and
only one activation per micro-batch crosses to the next stage); besides one group per mesh dimension, each rank
gets the dp x cp group of its (pp, tp) index (DP_CP), over which the gradients of parameters replicated across cp
are reduced, and at pp > 1 the group of the first and last stage at its (dp, cp, tp) index (EMBEDDING), over which
the two copies of tied embeddings sum their gradients.
"""

from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

ProcessGroup = dist.ProcessGroup

# outermost first (world = pp x dp x cp x tp); a caller's mesh may leave out pp and cp (size 1)
MESH_DIMS = ("pp", "dp", "cp", "tp")
ADOPTABLE = (MESH_DIMS, ("dp", "cp", "tp"), ("pp", "dp", "tp"), ("dp", "tp"))
DP_CP = "dp_cp"  # the flattened dp x cp group of gradient reduction (not a mesh dimension)
EMBEDDING = "embedding"  # the first and the last pipeline stage (tied embeddings; None at pp = 1)
# this rank's one-way pipeline links (None at pp = 1): (kind, this rank's end) -> the group's name among the groups
PP_LINKS = {("activation", "send"): "pp_activation_send", ("activation", "receive"): "pp_activation_receive",
            ("gradient", "send"): "pp_gradient_send", ("gradient", "receive"): "pp_gradient_receive"}
# NCCL's flight recorder: each rank keeps its last 2000 collectives and dumps them when the watchdog times out
# (to TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>, torch's default /tmp/nccl_trace_rank_<rank>; docs/failure-modes.md)
NCCL_DIAGNOSTICS = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def nccl_diagnostics_env(backend: str, world_size: int, environ) -> dict[str, str]:
    """What a multi-GPU run adds to its environment before the NCCL groups exist: the flight recorder and its dump on
    timeout (NCCL_DIAGNOSTICS), each unless `environ` sets it (an explicit setting wins); nothing on gloo or alone."""
    if backend != "nccl" or world_size < 2:
        return {}
    return {name: value for name, value in NCCL_DIAGNOSTICS.items() if name not in environ}
EXPERT = "ep"  # expert parallelism: ep consecutive ranks of a dp x cp group (None at ep = 1)
EXPERT_DATA = "ep_data"  # the dp x cp ranks that hold the same experts (None at ep = 1)


def group_timeout(group: ProcessGroup | None) -> datetime.timedelta | None:
    """The timeout `group` (None: the world) was created with, or None where torch does not say."""
    try:  # private API; a torch without it says nothing
        from torch.distributed import distributed_c10d

        group = group if group is not None else distributed_c10d._get_default_group()
        device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        return group._get_backend(device).options._timeout
    except Exception:
        return None


def device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def build_mesh(sizes: dict[str, int], timeout, ep: int = 1) -> tuple[DeviceMesh, dict[str, ProcessGroup]]:
    """The mesh of `sizes` (MESH_DIMS order, consecutive ranks along the last) and this rank's group along each
    dimension, made with `timeout` (init_device_mesh would give its groups torch's 30-minute default instead)."""
    ranks = torch.arange(dist.get_world_size()).view(*sizes.values())
    groups = {name: new_groups(ranks.movedim(dim, -1).reshape(-1, sizes[name]), timeout, name)
              for dim, name in enumerate(sizes)}
    mesh = DeviceMesh.from_group([groups[n] for n in sizes], device_type(), mesh=ranks, mesh_dim_names=tuple(sizes))
    groups.update(derived_groups(ranks, sizes["cp"] == 1, groups["dp"], timeout))
    groups.update(expert_groups(ranks, ep, timeout))
    return mesh, groups


def expert_groups(ranks: torch.Tensor, ep: int, timeout) -> dict[str, ProcessGroup | None]:
    """EXPERT and EXPERT_DATA of the [pp, dp, cp, tp] grid: each dp x cp group (cp inner) cut into runs of ep
    consecutive members (Megatron's parallel folding: experts split over data and context-parallel ranks), and the
    members at the same place in each run. None at ep = 1."""
    pp, dp, cp, tp = ranks.shape
    if ep == 1:
        return {EXPERT: None, EXPERT_DATA: None}
    if (dp * cp) % ep:
        raise ValueError(f"expert_model_parallel_size={ep} must divide data x context-parallel size {dp * cp}: the "
                         "expert-parallel group folds over those ranks.")
    folded = ranks.flatten(1, 2).movedim(1, -1).reshape(-1, dp * cp // ep, ep)
    return {EXPERT: new_groups(folded.reshape(-1, ep), timeout, EXPERT),
            EXPERT_DATA: new_groups(folded.transpose(1, 2).reshape(-1, dp * cp // ep), timeout, EXPERT_DATA)}


def derived_groups(ranks: torch.Tensor, cp_is_one: bool, dp_group, timeout) -> dict[str, ProcessGroup | None]:
    """DP_CP, EMBEDDING and the PP_LINKS of the [pp, dp, cp, tp] rank grid. At cp = 1 the dp x cp group is the dp
    group itself (no extra groups, DDP on the group it always had); at pp = 1 there is no embedding group and no
    pipeline link."""
    pp, dp, cp, tp = ranks.shape
    dp_cp = dp_group if cp_is_one else new_groups(ranks.flatten(1, 2).movedim(1, -1).reshape(-1, dp * cp),
                                                  timeout, DP_CP)
    if pp == 1:
        return {DP_CP: dp_cp, EMBEDDING: None, **dict.fromkeys(PP_LINKS.values())}
    ends = torch.stack([ranks[0], ranks[-1]], dim=-1).reshape(-1, 2)
    links = pipeline_link_groups(ranks.movedim(0, -1).reshape(-1, pp), timeout)
    return {DP_CP: dp_cp, EMBEDDING: new_groups(ends, timeout, EMBEDDING),
            **{PP_LINKS[key]: group for key, group in links.items()}}


def pipeline_link_groups(rows: torch.Tensor, timeout) -> dict[tuple[str, str], ProcessGroup]:
    """This rank's four one-way links, by (kind, this rank's end) as PP_LINKS names them, of the pipelines whose
    global ranks are `rows` ([n, p], in stage order): activations go from stage s to s+1, gradients from s to s-1
    (mod p), each ordered pair and direction on its own group of two. NCCL runs a communicator's operations in
    order, so a communicator that carried both directions could hold a send behind a receive that the peer's own
    send blocks; one that carries one kind one way cannot (`pipeline/messages.py`). Each group is warmed as it is
    made (`warm_up`)."""
    p, me, links = rows.shape[1], dist.get_rank(), {}
    for kind, step in (("activation", 1), ("gradient", -1)):
        for s in range(p):
            group = new_groups(torch.stack([rows[:, s], rows[:, (s + step) % p]], dim=-1), timeout,
                               f"pp_{kind}_link")
            if group is not None:
                warm_up(group)
                links[(kind, "send" if me in rows[:, s].tolist() else "receive")] = group
    return links


def warm_up(group: ProcessGroup) -> None:
    """One collective of all the group's ranks, right where it is made. A group made lazily (a caller's mesh built
    without a bound device) creates its communicator at its first operation, which blocks until every member
    joins: there, in the one order in which every rank makes the groups, not at a pipeline exchange in the middle
    of a schedule. And torch allows a batch of point-to-point operations as a group's first collective only when
    every rank of the group takes part. Group creation, like this warm-up, is this module's own business; every
    other collective goes through `collectives`."""
    nccl = "nccl" in str(dist.get_backend(group))  # NCCL, alone or beside gloo ("cpu:gloo,cuda:nccl")
    dist.all_reduce(torch.zeros(1, device="cuda" if nccl else "cpu"), group=group)


def splits_in_one_call() -> bool:
    """Whether torch can make every row's group in one `split_group` call (one split of the world's communicator,
    where a new_group per row is one world-wide split each): NCCL with the world bound to a device (init_distributed
    binds it); gloo cannot split."""
    return (hasattr(dist, "split_group") and dist.get_backend() == "nccl"
            and getattr(dist.group.WORLD, "bound_device_id", None) is not None)


def new_groups(rows: torch.Tensor, timeout, desc: str | None = None) -> ProcessGroup:
    """One group per row of global ranks, every rank taking part in each; this rank's one. `desc` names the groups
    in torch's own messages (NCCL's watchdog prints it beside a timed-out operation)."""
    if splits_in_one_call():
        return dist.split_group(split_ranks=rows.tolist(), timeout=timeout, group_desc=desc)
    mine = None
    for members in rows.tolist():  # every rank creates each, in the same order
        group = dist.new_group(members, timeout=timeout, group_desc=desc)
        mine = group if dist.get_rank() in members else mine
    return mine


def adopt_mesh(mesh: DeviceMesh, ep: int = 1) -> tuple[dict[str, ProcessGroup | None], datetime.timedelta | None]:
    """The caller's mesh's groups and their timeout. Its dimensions are MESH_DIMS or leave out pp and/or cp (each
    then has size 1: its group is None); dp x cp and the embedding group are made from the mesh's ranks."""
    names = tuple(mesh.mesh_dim_names or ())
    if names not in ADOPTABLE:
        raise ValueError(f"initialize_model_parallel(mesh=...): the mesh's dimensions are {names}; it needs exactly "
                         f"{MESH_DIMS} (outermost first), or that without 'pp' and/or 'cp' (e.g. ('dp', 'tp')): "
                         f"build it with init_device_mesh(device, shape, mesh_dim_names={MESH_DIMS}).")
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"initialize_model_parallel(mesh=...): the mesh holds {mesh.size()} ranks but the world has "
                         f"{dist.get_world_size()}: make the mesh over every rank.")
    groups = {name: mesh.get_group(name) for name in names}
    timeout = group_timeout(groups["tp"])
    ranks = mesh.mesh
    for dim, name in enumerate(MESH_DIMS):  # the grid as [pp, dp, cp, tp]
        if name not in names:
            ranks = ranks.unsqueeze(dim)
    cp_is_one = "cp" not in names or mesh.size(names.index("cp")) == 1
    groups = {"pp": None, "cp": None, **groups}
    groups.update(derived_groups(ranks, cp_is_one, groups["dp"], timeout))
    groups.update(expert_groups(ranks, ep, timeout))
    return groups, timeout


def data_context_mesh(mesh: DeviceMesh, groups: dict[str, ProcessGroup | None]) -> DeviceMesh:
    """The 1-D mesh over this rank's dp x cp group (FSDP2's, at zero_stage 3): mesh["dp"] where that group is the
    dp group (cp = 1), else a mesh on the DP_CP group itself (`DeviceMesh.from_group`: no new group, its timeout
    kept; `_flatten` would make another group with torch's default timeout)."""
    if groups[DP_CP] is groups["dp"]:
        return mesh["dp"]
    return DeviceMesh.from_group(groups[DP_CP], mesh.device_type, mesh_dim_names=(DP_CP,))


def data_parallel_size(p: int, c: int, pp: int = 1) -> int:
    world = dist.get_world_size()
    for name, size in (("tensor_model_parallel_size", p), ("context_parallel_size", c),
                       ("pipeline_model_parallel_size", pp)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name}={size!r} must be a positive integer.")
    stages = {"pipeline_model_parallel_size": pp} if pp > 1 else {}
    return layout_data_parallel_size(
        world, {"tensor_model_parallel_size": p, "context_parallel_size": c, **stages},
        "world size {world} is not a multiple of {named} = {product}: launch a multiple of {product} processes or "
        "choose sizes whose product divides {world}.")


def layout_data_parallel_size(world: int, sizes: dict[str, int], refusal: str) -> int:
    """world // the product of `sizes` (tensor x context [x pipeline] parallel): the data-parallel size. The one
    check of a layout against the world, for initialize_model_parallel and for the run config (before any process
    group); each caller keeps its own words, which name the sizes as its users set them: `refusal` is formatted
    with `named` ("name=size x ..."), `product` and `world`."""
    product = math.prod(sizes.values())
    if world % product != 0:
        named = " x ".join(f"{name}={size}" for name, size in sizes.items())
        raise ValueError(refusal.format(named=named, product=product, world=world))
    return world // product
