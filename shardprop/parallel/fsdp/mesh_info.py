"""fully_shard's data-parallel mesh descriptions (torch 2.15's names) and ``dp_mesh_dims`` planning.

``FSDPMeshInfo`` / ``HSDPMeshInfo`` / ``DDPMeshInfo`` say which dim of a mesh shards and
which replicates; ``get_mesh_info(mesh, dp_mesh_dims)`` (torch's ``_get_mesh_info``) builds
one, picking (and flattening) the data-parallel dims out of a whole SPMD mesh; a
``shard_placement_fn`` may answer with a ``ShardPlacementResult``. :func:`plan_dp_mesh_dims`
maps ``fully_shard(mesh, dp_mesh_dims=...)`` onto what shardprop's fully_shard runs:
FSDP on a 1-d mesh, HSDP on a (replicate, shard) mesh, or FSDP over one dim of a
(dp, tp) mesh.

Example:
    >>> info = get_mesh_info(mesh, DataParallelMeshDims(shard="dp_shard"))  # doctest: +SKIP
    >>> info.shard_mesh_size  # doctest: +SKIP
    4
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

from shardprop.parallel.fsdp.api import DataParallelMeshDims


@dataclass
class DataParallelMeshInfo:
    """A data-parallel mesh and which of its dims shard and replicate (torch's base class).

    Example:
        >>> DataParallelMeshInfo(mesh, shard_mesh_dim=0)  # doctest: +SKIP
    """

    mesh: object
    shard_mesh_dim: Optional[int] = None
    replicate_mesh_dim: Optional[int] = None
    dp_mesh_dims: Optional[DataParallelMeshDims] = None
    spmd_mesh: object = field(default=None, repr=False)  # the whole mesh, with dp_mesh_dims
    is_spmd_mesh: bool = field(default=False, init=False, repr=False)

    def __post_init__(self):
        if self.shard_mesh_dim is None and self.replicate_mesh_dim is None:
            raise ValueError("DataParallelMeshInfo: give shard_mesh_dim or replicate_mesh_dim")
        self.is_spmd_mesh = self.dp_mesh_dims is not None


@dataclass
class FSDPMeshInfo(DataParallelMeshInfo):
    """Sharding over ``mesh`` dim ``shard_mesh_dim``: its size, process group and this rank's index.

    Example:
        >>> FSDPMeshInfo(mesh["dp"], shard_mesh_dim=0).shard_mesh_size  # doctest: +SKIP
        4
    """

    def __post_init__(self):
        super().__post_init__()
        if self.shard_mesh_dim is None:
            raise ValueError("FSDPMeshInfo: shard_mesh_dim is required")
        self.shard_mesh_size: int = self.mesh.size(self.shard_mesh_dim)
        self.shard_process_group = self.mesh.get_group(self.shard_mesh_dim)
        self.shard_mesh_rank: int = self.mesh.get_local_rank(self.shard_mesh_dim)
        self.reduce_scatter_process_group = None  # torch: an optional separate group; shardprop uses the shard group


@dataclass
class DDPMeshInfo(DataParallelMeshInfo):
    """Replication over ``mesh`` dim ``replicate_mesh_dim``: its size, process group and this rank's index.

    Example:
        >>> DDPMeshInfo(mesh["dp"], replicate_mesh_dim=0).replicate_mesh_size  # doctest: +SKIP
        4
    """

    def __post_init__(self):
        super().__post_init__()
        if self.replicate_mesh_dim is None:
            raise ValueError("DDPMeshInfo: replicate_mesh_dim is required")
        self.replicate_mesh_size: int = self.mesh.size(self.replicate_mesh_dim)
        self.replicate_process_group = self.mesh.get_group(self.replicate_mesh_dim)
        self.replicate_mesh_rank: int = self.mesh.get_local_rank(self.replicate_mesh_dim)


@dataclass
class HSDPMeshInfo(FSDPMeshInfo, DDPMeshInfo):
    """Both: shard over ``shard_mesh_dim``, replicate over ``replicate_mesh_dim``.

    Example:
        >>> HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)  # doctest: +SKIP
    """


@dataclass
class ShardPlacementResult:
    """What a ``shard_placement_fn`` may return: a ``Shard`` placement (or None) and the mesh info to shard on.

    shardprop's fully_shard takes it when ``mesh_info`` describes the mesh fully_shard was given
    (one unit per call); another mesh per parameter is refused with an error naming it.

    Example:
        >>> ShardPlacementResult(placement=Shard(1), mesh_info=info)  # doctest: +SKIP
    """

    placement: object
    mesh_info: FSDPMeshInfo


def _check_names(mesh, dims: DataParallelMeshDims) -> None:
    if not mesh.mesh_dim_names:
        raise ValueError(f"fully_shard: dp_mesh_dims needs a mesh with named dims, got {mesh}")
    for name in dims.shard_names + dims.replicate_names:
        if name not in mesh.mesh_dim_names:
            raise ValueError(f"fully_shard: dp_mesh_dims names the mesh dim {name!r}, which is not among "
                             f"the mesh's dims {mesh.mesh_dim_names}")


def flat_submesh(mesh, names: Tuple[str, ...]):
    """The 1-d mesh over ``mesh``'s dims ``names`` through this rank, flattened in that order.

    No group is created: a mesh holds a group for each set of up to 3 of its dims, and the
    flattened mesh reuses it (torch's ``mesh[names]._flatten()`` creates one).

    Example:
        >>> flat_submesh(mesh, ("dp_shard", "cp")).size() == mesh.size("dp_shard") * mesh.size("cp")  # doctest: +SKIP
        True
    """
    if len(names) == 1:
        return mesh[names[0]]
    from shardprop.mesh.device_mesh import DeviceMesh
    sub = mesh[tuple(names)]
    flat = DeviceMesh(mesh.device_type, sub.mesh.flatten(), ("_".join(names),), _parent=mesh)
    if flat.group_for((0,)) is None or flat.group_for((0,))[0] is None:
        raise NotImplementedError(f"fully_shard: flattening the mesh dims {names} of {mesh}: the mesh has no group "
                                  f"over them in that order; list them in the mesh's own dim order")
    return flat


def get_mesh_info(mesh, dp_mesh_dims: Optional[DataParallelMeshDims] = None) -> DataParallelMeshInfo:
    """The mesh info torch 2.15's fully_shard builds for ``mesh`` (``_get_mesh_info``).

    Without ``dp_mesh_dims``: a 1-d mesh shards (FSDP), a 2-d one replicates over dim 0 and
    shards over dim 1 (HSDP). With it, the data-parallel dims are picked out of the whole mesh
    (several names flattened into one dim); no shard dim gives a DDPMeshInfo.

    Example:
        >>> get_mesh_info(mesh["dp"]).shard_mesh_dim  # doctest: +SKIP
        0
    """
    if dp_mesh_dims is None:
        if mesh.ndim == 1:
            return FSDPMeshInfo(mesh, shard_mesh_dim=0)
        return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    _check_names(mesh, dp_mesh_dims)
    shard, rep = dp_mesh_dims.shard_names, dp_mesh_dims.replicate_names
    if not shard:
        return DDPMeshInfo(flat_submesh(mesh, rep), replicate_mesh_dim=0, dp_mesh_dims=dp_mesh_dims, spmd_mesh=mesh)
    if not rep:
        return FSDPMeshInfo(flat_submesh(mesh, shard), shard_mesh_dim=0, dp_mesh_dims=dp_mesh_dims, spmd_mesh=mesh)
    return HSDPMeshInfo(_hsdp_mesh(mesh, rep, shard), shard_mesh_dim=1, replicate_mesh_dim=0,
                        dp_mesh_dims=dp_mesh_dims, spmd_mesh=mesh)


_get_mesh_info = get_mesh_info  # torch's private name, which torchtitan imports


def _hsdp_mesh(mesh, rep: Tuple[str, ...], shard: Tuple[str, ...]):
    if len(rep) > 1 or len(shard) > 1:
        raise NotImplementedError(f"fully_shard: dp_mesh_dims with several replicate dims {rep} or several shard "
                                  f"dims {shard} together (HSDP over flattened dims) is not supported")
    if tuple(mesh.mesh_dim_names) == rep + shard:
        return mesh  # the parameters' specs then stay on the mesh they came on
    return mesh[rep + shard]


@dataclass
class SpmdPlan:
    """How ``fully_shard(mesh, dp_mesh_dims=...)`` runs: see :func:`plan_dp_mesh_dims`."""

    spmd_mesh: object        # the whole mesh the parameters are DTensors on
    fsdp_mesh: object        # what shardprop's fully_shard shards over: 1-d, or 2-d (replicate, shard)
    dp_dims: Tuple[int, ...]  # the data-parallel dims' indices in spmd_mesh
    shard_dim: int           # the shard dim's index in spmd_mesh (with other dims: the only one)
    other: Tuple[int, ...]   # the other (model-parallel) dims' indices in spmd_mesh


def plan_dp_mesh_dims(mesh, dims: DataParallelMeshDims) -> SpmdPlan:
    """Map ``dp_mesh_dims`` on the whole mesh onto a mesh shardprop's fully_shard supports.

    Supported: only data-parallel dims (FSDP over one or several flattened shard dims, or HSDP
    over one replicate and one shard dim), or one shard dim beside one model-parallel dim
    (FSDP + TP). Any other combination raises NotImplementedError naming it.

    Example:
        >>> plan_dp_mesh_dims(mesh, DataParallelMeshDims(shard="dp_shard")).fsdp_mesh  # doctest: +SKIP
    """
    if not isinstance(dims, DataParallelMeshDims):
        raise TypeError(f"fully_shard: dp_mesh_dims must be a DataParallelMeshDims, got {type(dims).__name__}")
    _check_names(mesh, dims)
    names = tuple(mesh.mesh_dim_names)
    shard, rep = dims.shard_names, dims.replicate_names
    if not shard:
        raise NotImplementedError(f"fully_shard: dp_mesh_dims={dims} has no shard dim (replicate only, DDP); "
                                  f"shardprop's fully_shard always shards: use shardprop's data parallel instead")
    dp = tuple(names.index(n) for n in rep + shard)
    other = tuple(i for i in range(len(names)) if i not in dp)
    if other and (rep or len(shard) > 1 or len(other) > 1):
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims={dims} on the mesh dims {names}: beside model-parallel dims "
            f"{tuple(names[i] for i in other)} only one shard dim and one model-parallel dim are supported "
            f"(FSDP + TP); HSDP, flattened shard dims or several model-parallel dims with them are not")
    if other:
        fsdp_mesh = mesh[shard[0]]
    elif rep:
        fsdp_mesh = _hsdp_mesh(mesh, rep, shard)
    else:
        fsdp_mesh = flat_submesh(mesh, shard)
    return SpmdPlan(mesh, fsdp_mesh, dp, names.index(shard[0]), other)


def check_spmd_param(fqn: str, p, plan: SpmdPlan) -> None:
    """A parameter under dp_mesh_dims: a DTensor on the whole mesh, Replicate on every data-parallel dim.

    Example:
        >>> check_spmd_param("w", model.w, plan)  # doctest: +SKIP
    """
    from shardprop.tensor.dtensor import DTensor
    from shardprop.tensor.placement import Replicate
    if not isinstance(p, DTensor):
        if plan.other:
            raise ValueError(f"fully_shard: with dp_mesh_dims on a mesh with model-parallel dims, every parameter "
                             f"must be a DTensor on that mesh (e.g. via distribute_module); {fqn!r} is a plain tensor")
        return
    spec = p._spec
    if spec.mesh != plan.spmd_mesh:
        raise ValueError(f"fully_shard: parameter {fqn!r} is a DTensor on {spec.mesh}, not on the mesh passed to "
                         f"fully_shard with dp_mesh_dims ({plan.spmd_mesh})")
    for i in plan.dp_dims:
        if type(spec.placements[i]) is not Replicate:
            raise ValueError(f"fully_shard: parameter {fqn!r} is {spec.placements[i]} on the data-parallel mesh dim "
                             f"{plan.spmd_mesh.mesh_dim_names[i]!r}; expected Replicate()")


__all__ = ["DataParallelMeshInfo", "FSDPMeshInfo", "DDPMeshInfo", "HSDPMeshInfo", "ShardPlacementResult",
           "get_mesh_info", "_get_mesh_info", "flat_submesh", "SpmdPlan", "plan_dp_mesh_dims", "check_spmd_param"]
