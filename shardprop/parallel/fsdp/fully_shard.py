"""fully_shard: fully sharded data parallelism (FSDP2's API) on shardprop DTensors.

``fully_shard(block)`` for each block, then ``fully_shard(model)``: every
parameter becomes a ``Shard`` DTensor over the dp mesh dim (an ``nn.Parameter``
still), so parameters, gradients and optimizer state take 1/dp of the memory.
Around each unit's forward the module computes on plain full tensors gathered by
one all-gather (prefetched one unit ahead, forward and backward; asynchronous except on
gloo, see the ``fsdp_async_gather`` setting); its gradients
leave in one reduce-scatter that overlaps the rest of backward (at most one in
flight: the next unit's launch completes the previous one, as torch's does). See
:mod:`shardprop.parallel.fsdp.unit` (run time) and :mod:`shardprop.parallel.fsdp.flat_buffers`
(memory layout).

On a ``("dp", "tp")`` mesh, after ``parallelize_module(model, mesh["tp"], plan)``,
``fully_shard(block, mesh=mesh["dp"])`` shards each tp-local tensor over dp. The
dp dim splits tensor dim 0, unless tp already splits dim 0 (column-parallel
weights): then dp splits dim 1, so the spec (``[S(1), S(0)]`` on the 2-D mesh) says
exactly what each rank holds; a 1-d such parameter (a column-parallel bias) stays
whole over dp (``[R, S(0)]``). A ``shard_placement_fn`` asking dp to split the dim tp splits
gets torch's ``[_StridedShard(0, split_factor=tp), S(0)]`` (still one run of the tensor per rank).
A ``ShardPlacementResult`` naming another mesh puts its parameter in a member unit over that mesh
(torchtitan's experts over "efsdp", the rest over the whole dp mesh, in one ``fully_shard`` call).

A 2-D ``mesh`` (replicate, shard) without ``dim`` is HSDP, as in torch: parameters
``[Replicate(), Shard(0)]``, gathered over the shard dim, gradients reduce-scattered
over it and then all-reduced across replicas. The module hooks live in
:mod:`shardprop.parallel.fsdp.hooks`, the run-time controls in
:mod:`shardprop.parallel.fsdp.module`.
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Optional, Set, Union

import torch
import torch.nn as nn

from shardprop.mesh import reshape as _reshape
from shardprop.parallel.fsdp.flat_buffers import REPLICATED, ParamSlot, UnitBuffers
from shardprop.parallel.fsdp.api import CPUOffloadPolicy, DataParallelMeshDims, OffloadPolicy
from shardprop.parallel.fsdp.hooks import post_forward, pre_forward
from shardprop.parallel.fsdp.mesh_info import check_spmd_param, plan_dp_mesh_dims
from shardprop.parallel.fsdp.module import FSDPModule
from shardprop.parallel.fsdp.spmd_types_params import as_storage
from shardprop.parallel.fsdp.unit import FSDPUnit
from shardprop.parallel.fsdp.mixed_precision import MixedPrecisionPolicy
from shardprop.tensor.dtensor import DTensor, make_spec
from shardprop.tensor.layout import chunk_bounds
from shardprop.tensor.placement import Replicate, Shard, _StridedShard, as_placement

_DEFAULT_MESHES: Dict[str, object] = {}
_POST_FORWARD_MESHES: Dict[tuple, object] = {}


def _slice(mesh, d: int):
    """The 1-d sub-mesh along dim ``d`` through this rank (named or not)."""
    from shardprop.mesh.device_mesh import DeviceMesh
    if mesh.mesh_dim_names:
        return mesh[mesh.mesh_dim_names[d]]
    index = tuple(slice(None) if i == d else mesh._coord[i] for i in range(mesh.ndim))
    return DeviceMesh(mesh.device_type, mesh.mesh[index], None, _parent=mesh)


def _resolve_meshes(mesh, dim, device_type: str):
    """(mesh of the parameters' specs, shard mesh, replicate mesh or None) for ``fully_shard(mesh=, dim=)``."""
    from shardprop.mesh.device_mesh import DeviceMesh
    import torch.distributed as dist
    if mesh is None:  # one dp dim over every rank, built once per device type
        if device_type not in _DEFAULT_MESHES:
            _DEFAULT_MESHES[device_type] = DeviceMesh(device_type, torch.arange(dist.get_world_size()), ("dp",))
        mesh = _DEFAULT_MESHES[device_type]
        return mesh, mesh, None
    if dim is None:
        if mesh.ndim == 1:
            return mesh, mesh, None
        if mesh.ndim == 2:  # HSDP, as torch: (replicate, shard)
            if mesh._coord is None:
                raise RuntimeError(f"fully_shard: this rank is not in the mesh {mesh}")
            return mesh, _slice(mesh, 1), _slice(mesh, 0)
        raise ValueError(f"fully_shard: a {mesh.ndim}-d mesh {mesh}: pass a 1-d mesh (FSDP), a 2-d "
                         f"(replicate, shard) mesh (HSDP), or dim=<the dp dim's name>")
    if isinstance(dim, str):
        names = mesh.mesh_dim_names or ()
        if dim not in names:
            raise ValueError(f"fully_shard: the mesh {mesh} has no dim {dim!r} (its dims are {tuple(names)}); "
                             f"pass mesh=mesh['dp'] or dim=<one of them>")
    elif not -mesh.ndim <= dim < mesh.ndim:
        raise ValueError(f"fully_shard: mesh dim {dim} does not exist on the {mesh.ndim}-d mesh {mesh}")
    if mesh.ndim == 1:
        return mesh, mesh, None
    if not mesh.mesh_dim_names:
        raise ValueError(f"fully_shard: name the dims of the {mesh.ndim}-d mesh {mesh} to pick the dp dim")
    sub = mesh[dim if isinstance(dim, str) else mesh.mesh_dim_names[dim]]
    return sub, sub, None


def _normalize_reshard(raf, shard_size: int):
    """``reshard_after_forward`` as True, False or a group size strictly between 1 and the shard size."""
    if raf is None or isinstance(raf, bool):
        return raf
    if not isinstance(raf, int):
        raise ValueError(f"fully_shard: reshard_after_forward should be a bool or an int (the group size to "
                         f"reshard to), not {raf!r}")
    if raf < 1 or raf > shard_size or shard_size % raf:
        raise ValueError(f"fully_shard: reshard_after_forward={raf}: an int must divide the shard group's "
                         f"size {shard_size}")
    if raf == 1:
        warnings.warn("fully_shard: reshard_after_forward=1 (int) keeps the whole parameters after forward, "
                      "as reshard_after_forward=False (bool) does", stacklevel=3)
        return False
    return True if raf == shard_size else raf


def _post_forward_mesh(shard_mesh, n: int):
    """The group of ``n`` consecutive shard ranks through this rank (built once, on every rank)."""
    from shardprop.mesh.device_mesh import DeviceMesh
    key = (_reshape.root_of(shard_mesh), shard_mesh._layout, n)
    if key not in _POST_FORWARD_MESHES:
        # Every copy of the shard mesh (one per coordinate of the other dims) too: creating groups is collective.
        layout = _reshape.full_ranks(shard_mesh).reshape(-1, n)
        _POST_FORWARD_MESHES[key] = DeviceMesh(shard_mesh.device_type, layout, ("rest", "group"))["group"]
    return _POST_FORWARD_MESHES[key]


def _root_modules(module) -> List[nn.Module]:
    """The modules of one unit: ``module``, or the listed ones not inside another listed one (as torch)."""
    if not isinstance(module, (list, tuple)):
        return [module]
    mods = list(module)
    if not mods or not all(isinstance(m, nn.Module) for m in mods):
        raise ValueError(f"fully_shard: a list of modules must hold at least one module, and only modules; "
                         f"got {[type(m).__name__ for m in mods]}")
    out = []
    for m in mods:
        inside = any(o is not m and any(d is m for d in o.modules()) for o in mods)
        if not inside and not any(o is m for o in out):
            out.append(m)
    return out


def _managed_params(roots: List[nn.Module], ignored: Set[int]):
    """(owner, name, fqn, param, aliases) for each parameter of ``roots`` not managed by a nested unit nor ignored.

    A parameter registered in several places (tied weights, e.g. an embedding and an output
    projection in one ``fully_shard([...])``) is one entry; its other (module, name) places are
    its ``aliases``, swapped along with it.
    """
    out, at, visited = [], {}, set()

    def visit(m, prefix, root):
        if m is not root and getattr(m, "_fsdp_unit", None) is not None:
            return
        if id(m) in visited:
            return
        visited.add(id(m))
        for name, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            if id(p) in at:
                out[at[id(p)]][4].append((m, name))
                continue
            at[id(p)] = len(out)
            out.append((m, name, prefix + name, p, []))
        for cname, child in m._modules.items():
            if child is not None:
                visit(child, prefix + cname + ".", root)

    for i, root in enumerate(roots):
        visit(root, "" if len(roots) == 1 else f"[{i}].", root)
    return out


def _chosen(fn, p):
    """What ``shard_placement_fn`` returns for ``p``, torch's placements taken as ours (None: the default).

    Of a ``ShardPlacementResult`` the placement (its mesh info chose the unit member, :func:`_shard_groups`).
    """
    pl = fn(p) if fn is not None else None
    if pl is not None and hasattr(pl, "mesh_info") and hasattr(pl, "placement"):
        pl = pl.placement
    return pl if pl is None else (as_placement(pl) or pl)


def _info_mesh(fn, p):
    """The mesh info a ``shard_placement_fn`` gives ``p`` in a ``ShardPlacementResult`` (None: the call's mesh)."""
    pl = fn(p) if fn is not None else None
    return getattr(pl, "mesh_info", None) if hasattr(pl, "placement") else None


def _shard_groups(params, fn, mesh, dim, plan, device_type: str):
    """The parameters by the mesh they shard over: [((spec mesh, shard mesh, replicate mesh), plan, params)].

    The call's mesh first. A ``shard_placement_fn`` returning a ``ShardPlacementResult`` whose mesh
    info is another mesh (torchtitan: routed experts over the expert-data-parallel mesh, the rest over
    the whole dp mesh) puts the parameter in that mesh's group; each group becomes one member unit.
    """
    default = _resolve_meshes(mesh, dim, device_type)
    groups = {}
    for entry in params:
        info = _info_mesh(fn, entry[3])
        key, g_plan = default, plan
        if info is not None:
            if getattr(info, "dp_mesh_dims", None) is not None:
                g_plan = plan_dp_mesh_dims(info.spmd_mesh, info.dp_mesh_dims)
                key = _resolve_meshes(g_plan.fsdp_mesh, None, device_type)
            else:
                g_plan, key = None, _resolve_meshes(info.mesh, None, device_type)
            if key[1] == default[1]:
                key, g_plan = default, plan
        groups.setdefault(key, (g_plan, []))[1].append(entry)
    ordered = sorted(groups.items(), key=lambda kv: kv[0] is not default)
    return [(meshes, g_plan, ps) for meshes, (g_plan, ps) in ordered] or [(default, plan, [])]


def _placement_dim(fn, fqn: str, p, D: int, local=None) -> int:
    """The dim ``shard_placement_fn`` picks for a plain parameter (0 when it returns None)."""
    pl = _chosen(fn, p)
    p = p if local is None else local
    if pl is None:
        return 0
    if type(pl) is not Shard:
        raise ValueError(f"fully_shard: shard_placement_fn returned {pl!r} for {fqn!r}; expected Shard(dim) or None")
    d = pl.dim + p.ndim if pl.dim < 0 else pl.dim
    if not 0 <= d < p.ndim:
        raise ValueError(f"fully_shard: shard_placement_fn returned {pl!r} for the {p.ndim}-d parameter {fqn!r}")
    if d and p.shape[d] % D:  # as torch: a dim other than 0 must split evenly
        raise NotImplementedError(f"fully_shard: parameter {fqn!r} sharded on dim {d}: its size {p.shape[d]} "
                                  f"must divide by the shard group's size {D}")
    return d


def _two_d_layout(fqn: str, p: DTensor, dp_mesh):
    """(2-d mesh, dp dim index in it, tp placement, tensor dim dp splits) for a DTensor parameter."""
    tp_mesh = p._spec.mesh
    parent = getattr(dp_mesh, "_parent", None)
    # Meshes compare by value (specs are interned, so the tp mesh may be an equal object sliced
    # earlier): when the tp mesh is the other dim of the 2-d mesh dp was sliced from, that mesh it is.
    other = None
    if (parent is not None and parent.ndim == 2 and parent.mesh_dim_names and tp_mesh.ndim == 1
            and dp_mesh.mesh_dim_names and dp_mesh.mesh_dim_names[0] in parent.mesh_dim_names):
        other = parent[[n for n in parent.mesh_dim_names if n != dp_mesh.mesh_dim_names[0]][0]]
    if other is None or other != tp_mesh:
        # Else the two meshes' dims, wherever sliced from (torchtitan slices dp and tp from two meshes
        # unflattened from one world), if together they form a 2-d mesh over one set of ranks.
        parent = _combine(fqn, dp_mesh, tp_mesh)
    dp_name, tp_name = dp_mesh.mesh_dim_names[0], tp_mesh.mesh_dim_names[0]
    (tp_pl,) = p._spec.placements
    return parent, parent.mesh_dim_names.index(dp_name), tp_pl, _dp_dim_beside(fqn, p, tp_pl, tp_name)


def _dp_dim_beside(fqn: str, p, tp_pl, tp_name: str) -> int:
    """The tensor dim dp splits of a parameter placed ``tp_pl`` on the tp dim (REPLICATED: none)."""
    if tp_pl.is_partial():
        raise NotImplementedError(f"fully_shard: parameter {fqn!r} is Partial on {tp_name!r}")
    dim = 0
    if type(tp_pl) is Shard and tp_pl.dim == 0:
        # Splitting the tp piece again on dim 0 would need a strided-shard placement (shardprop has
        # none). dp splits dim 1 of a column-parallel weight instead ([S(1) on dp, S(0) on tp] is
        # exact); a 1-d one (a bias) stays whole on every dp rank ([R on dp, S(0) on tp]).
        dim = 1 if p.ndim >= 2 else REPLICATED
    return dim


def _combine(fqn: str, dp_mesh, tp_mesh):
    """The 2-d (dp, tp) mesh of a parameter's dp and tp meshes; a clear error when they do not form one."""
    from shardprop.mesh.device_mesh import DeviceMesh
    why = None
    if tp_mesh.ndim != 1 or not tp_mesh.mesh_dim_names or not dp_mesh.mesh_dim_names:
        why = "both must be 1-d meshes with named dims"
    elif not _reshape.same_universe(dp_mesh, tp_mesh):
        why = "they are over different sets of ranks"
    else:
        try:
            both = DeviceMesh._concatenate([dp_mesh, tp_mesh])
        except (RuntimeError, ValueError) as e:
            why = f"their dims overlap ({e})"
        else:
            if both._coord is not None:
                return both
            why = "this rank is not in both"
    raise ValueError(f"fully_shard: parameter {fqn!r} is a DTensor on {tp_mesh}, which does not combine with the dp "
                     f"mesh {dp_mesh} into a 2-d (dp, tp) mesh: {why}; slice both from meshes over one world whose "
                     f"dp and tp dims are different dims (e.g. one ('dp', 'tp') mesh)")


def _splits_tp_dim(fn, p: DTensor, tp_pl) -> bool:
    """Whether ``shard_placement_fn`` asks dp to split the tensor dim tp already splits (``Shard(0)`` for
    experts ``Shard(0)`` over ep, as torchtitan asks when the experts outnumber efsdp x ep).

    Then dp splits the tp piece's dim again and the dp mesh dim's placement is torch's
    ``_StridedShard(dim, split_factor=tp size)``: each rank's piece is still one run of the tensor.
    """
    pl = _chosen(fn, p)
    if type(pl) is not Shard or type(tp_pl) is not Shard:
        return False
    return (pl.dim + p.ndim if pl.dim < 0 else pl.dim) == tp_pl.dim


def _check_fixed_dim(fn, fqn: str, p: DTensor, sdim: int) -> None:
    """``shard_placement_fn`` on a DTensor parameter may only name the dim dp splits anyway.

    Why: torchtitan passes ``lambda p: Shard(1)`` for experts already ``Shard(0)`` over ep; that
    is exactly the layout chosen here, so it is accepted. The dim tp splits is taken too
    (:func:`_splits_tp_dim`, a strided shard); any other dim is refused.
    """
    pl = _chosen(fn, p)
    if pl is None:
        return
    d = pl.dim + p.ndim if type(pl) is Shard and pl.dim < 0 else getattr(pl, "dim", None)
    if type(pl) is not Shard or d != sdim:
        fixed = "none (it stays whole over dp)" if sdim == REPLICATED else f"Shard({sdim})"
        raise NotImplementedError(f"fully_shard: shard_placement_fn returned {pl!r} for the DTensor parameter "
                                  f"{fqn!r}; beside its {p._spec.placements} on {p._spec.mesh} the dp dim's tensor "
                                  f"dim is fixed: {fixed}")


def _compute_device(mesh, offload: bool, first):
    """Where the full parameters live: the parameters' device, or the mesh's accelerator when offloading."""
    if not offload or mesh.device_type == "cpu":
        return first.device
    accel = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, accel.current_device())


def _layout(fqn: str, p, fn, dp_mesh, spec_mesh, rep_mesh, plan):
    """(local tensor to shard, dim dp splits, sharded spec, spec of the full DTensor or None, dims kept in grads,
    and for a parameter annotated by spmd_types the model-parallel dims its gradient is summed over, else None)."""
    D = dp_mesh.size()
    if plan is not None:
        annotated = as_storage(fqn, p, plan) if plan.other else None  # spmd_types' plain pieces
        if annotated is not None:
            local, sdim, spec, tp_spec, keep, _ = _layout(fqn, annotated[0], fn, dp_mesh, spec_mesh, rep_mesh, plan)
            return local, sdim, spec, tp_spec, keep, annotated[1]
        check_spmd_param(fqn, p, plan)
    if isinstance(p, DTensor) and (plan is None or plan.other):
        if plan is None:
            parent, dp_at, tp_pl, sdim = _two_d_layout(fqn, p, dp_mesh)
        else:  # dp_mesh_dims: the parameter lives on the whole (dp, tp) mesh, Replicate on dp
            parent, dp_at = plan.spmd_mesh, plan.shard_dim
            tp_pl = p._spec.placements[plan.other[0]]
            sdim = _dp_dim_beside(fqn, p, tp_pl, plan.spmd_mesh.mesh_dim_names[plan.other[0]])
        local = p._local_tensor.detach()
        strided = _splits_tp_dim(fn, p, tp_pl)
        if strided:  # dp splits the tp piece's own dim: torch's right-to-left layout
            sdim = tp_pl.dim
            dp_pl = _StridedShard(sdim, split_factor=parent.size(1 - dp_at))
        else:
            _check_fixed_dim(fn, fqn, p, sdim)
            dp_pl = Shard(sdim) if sdim != REPLICATED else Replicate()
        if (sdim > 0 or strided) and local.shape[sdim] % D:
            raise NotImplementedError(f"fully_shard: parameter {fqn!r}: its tp-local dim {sdim} "
                                      f"({local.shape[sdim]}) must divide by dp={D}")
        placements = [None, None]
        placements[dp_at], placements[1 - dp_at] = dp_pl, tp_pl
        keep = plan.dp_dims if plan is not None else ()
        return local, sdim, make_spec(parent, placements, p.shape, dtype=p.dtype), p._spec, keep, None
    full_spec, keep = None, ()
    if isinstance(p, DTensor):  # dp_mesh_dims, data-parallel dims only: Replicate everywhere, local = whole
        local, full_spec, keep = p._local_tensor.detach(), p._spec, plan.dp_dims
    else:
        local = p.detach()
    sdim = _placement_dim(fn, fqn, p, D, local)
    placements = [Shard(sdim)] if rep_mesh is None else [Replicate(), Shard(sdim)]
    return local, sdim, make_spec(spec_mesh, placements, p.shape, dtype=p.dtype), full_spec, keep, None


def fully_shard(module: Union[nn.Module, List[nn.Module]], *, mesh=None,
                reshard_after_forward: Union[bool, int, None] = None,
                shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: Optional[Set[nn.Parameter]] = None,
                dp_mesh_dims: Optional[DataParallelMeshDims] = None, dim=None):
    """Shard ``module``'s parameters over the dp mesh dim; gather them around its forward and backward.

    Apply it to each block first, then to the root (a unit owns the parameters not
    owned by a nested unit). Every rank must build the model identically (same
    initial values): each keeps its own piece. ``mesh``: a 1-d dp mesh (FSDP), a 2-d
    (replicate, shard) mesh (HSDP), or any mesh with ``dim`` naming its dp dim; the
    default is one dim over all ranks. ``reshard_after_forward``: True frees the
    gathered parameters after forward, False keeps them, an int N keeps a 1/N piece
    and re-gathers within groups of N ranks in backward, None is True except for
    the root. ``shard_placement_fn(param)`` may return ``Shard(d)`` to split another
    dim. ``ignored_params`` stay as they are (not sharded, gradients not reduced).
    After backward, ``param.grad`` holds the dp-averaged gradient's shard.

    A list of modules is one unit (one all-gather, one reduce-scatter): gathered before
    the first of them runs, resharded once all of them ran (or when the root's forward
    ends); each becomes an FSDPModule, and the list is returned. ``dp_mesh_dims``
    (:class:`DataParallelMeshDims`) names the data-parallel dims of ``mesh``, a whole mesh
    the parameters are DTensors on, Replicate on those dims (see
    :func:`shardprop.parallel.fsdp.mesh_info.plan_dp_mesh_dims` for what is supported).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8))
        >>> for block in (model[0], model[2]):
        ...     _ = fully_shard(block, mesh=mesh["dp"])
        >>> _ = fully_shard(model, mesh=mesh["dp"])          # the root owns what is left (the norm)
        >>> model[0].weight.placements, model[0].weight.to_local().shape
        ((S(0),), torch.Size([4, 8]))
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> loss = model(torch.randn(2, 8)).mean(); loss.backward(); opt.step()
        >>> model[0].weight.grad.placements                 # the dp-averaged gradient's shard
        (S(0),)

        torchtitan's grouping of several modules into one unit:

        >>> fully_shard([model.norm, model.output], mesh=mesh["dp"])  # doctest: +SKIP
    """
    roots = _root_modules(module)
    _check_arguments(roots, mp_policy, offload_policy)
    plan, mesh = _dp_mesh_dims_plan(mesh, dim, dp_mesh_dims, reshard_after_forward)
    first = next((p for m in roots for p in m.parameters()), None)
    ignored = {id(p) for p in (ignored_params or ())}
    groups = _shard_groups(_managed_params(roots, ignored), shard_placement_fn, mesh, dim, plan,
                           first.device.type if first is not None else "cpu")
    units = [_build_unit(roots, params, meshes, g_plan, shard_placement_fn, reshard_after_forward, mp_policy,
                         offload_policy) for meshes, g_plan, params in groups]
    unit = units[0]
    unit.add_members(units[1:])
    _install(roots, unit)
    return module


# ---------------------------------------------------------------- fully_shard's steps


def _check_arguments(roots, mp_policy, offload_policy) -> None:
    for m in roots:
        if getattr(m, "_fsdp_unit", None) is not None:
            raise ValueError(f"fully_shard: {type(m).__name__} is already fully_shard-ed; wrap each module once")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}")


def _dp_mesh_dims_plan(mesh, dim, dp_mesh_dims, reshard_after_forward):
    """(plan, mesh to shard over): with ``dp_mesh_dims``, its plan and the mesh of its dp dims; else (None, mesh)."""
    if dp_mesh_dims is None:
        return None, mesh
    if mesh is None or dim is not None:
        raise ValueError("fully_shard: dp_mesh_dims needs mesh= (the whole mesh) and no dim=")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError("fully_shard: reshard_after_forward as an int with dp_mesh_dims (as in torch)")
    plan = plan_dp_mesh_dims(mesh, dp_mesh_dims)
    return plan, plan.fsdp_mesh


def _offload(offload_policy, dp_mesh):
    """(offload to host memory, pin it)."""
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    pin = offload and offload_policy.pin_memory
    if pin and dp_mesh.device_type == "cpu":
        raise RuntimeError("fully_shard: CPUOffloadPolicy(pin_memory=True) on a CPU mesh: pinning host memory "
                           "needs an accelerator, and on a CPU mesh the parameters already live in host memory; "
                           "pass CPUOffloadPolicy(pin_memory=False) (a no-op there) or no offload_policy")
    return offload, pin


def _build_unit(roots, params, meshes, plan, fn, reshard_after_forward, mp_policy, offload_policy) -> FSDPUnit:
    """One unit over ``roots`` for ``params``, all sharded over one mesh (``meshes``: see :func:`_shard_groups`)."""
    spec_mesh, dp_mesh, rep_mesh = meshes
    if dp_mesh._coord is None:
        raise RuntimeError(f"fully_shard: this rank is not in the dp mesh {dp_mesh}")
    offload, pin = _offload(offload_policy, dp_mesh)
    raf = _normalize_reshard(reshard_after_forward, dp_mesh.size())
    pf_mesh = _post_forward_mesh(dp_mesh, raf) if not isinstance(raf, bool) and raf is not None else None
    _check_unit_params(roots, params, dp_mesh, rep_mesh, plan)
    slots, sources, specs = _slots(params, fn, dp_mesh, spec_mesh, rep_mesh, plan)
    buffers = _shard(slots, sources, specs, _compute_dtype(params, mp_policy), mp_policy, dp_mesh, offload, pin)
    return FSDPUnit(tuple(roots), slots, buffers, dp_mesh, True if raf is None else raf, mp_policy,
                    replicate_mesh=rep_mesh, post_forward_mesh=pf_mesh, auto_reshard=raf is None, offload=offload)


def _check_unit_params(roots, params, dp_mesh, rep_mesh, plan) -> None:
    """The DTensor parameters sharded over ``dp_mesh`` share one mesh (and HSDP has none)."""
    names = "+".join(type(m).__name__ for m in roots)
    meshes = {p._spec.mesh for *_, p, _ in params if isinstance(p, DTensor)}
    if len(meshes) > 1:
        raise ValueError(f"fully_shard: the parameters of {names} sharded over {dp_mesh} live on different meshes "
                         f"{sorted(map(repr, meshes))}; one unit's parameters must share one mesh")
    if meshes and rep_mesh is not None and plan is None:
        raise NotImplementedError("fully_shard: HSDP (a 2-d mesh) over DTensor (tensor-parallel) parameters; "
                                  "pass the dp dim's mesh, e.g. mesh=mesh['dp']")


def _slots(params, fn, dp_mesh, spec_mesh, rep_mesh, plan):
    """(a ParamSlot, the local tensor to shard, the sharded spec) per parameter, of one dtype."""
    D, me = dp_mesh.size(), dp_mesh._coord[0]
    slots, sources, specs = [], [], []
    for m, name, fqn, p, aliases in params:
        if p.ndim == 0:
            raise NotImplementedError(f"fully_shard: parameter {fqn!r} is 0-d; give it shape (1,)")
        local, sdim, spec, tp_spec, keep, summed = _layout(fqn, p, fn, dp_mesh, spec_mesh, rep_mesh, plan)
        slots.append(ParamSlot(m, name, fqn, None, local.shape, sdim, D, me, p.dtype, p.requires_grad,
                               tp_spec=tp_spec, keep_dims=tuple(keep), aliases=aliases,
                               plain_compute=summed is not None, grad_sum_dims=summed or ()))
        sources.append(local)
        specs.append(spec)
    dtypes = {s.orig_dtype for s in slots}
    if len(dtypes) > 1:
        raise NotImplementedError(f"fully_shard: parameters of one unit must share a dtype, got {sorted(map(str, dtypes))}")
    return slots, sources, specs


def _compute_dtype(params, mp_policy):
    """The one dtype the unit's parameters compute in (one flat gather per unit: one dtype), or None."""
    compute = {mp_policy.param_compute_dtype(p) for *_, p, _ in params}
    if len(compute) > 1:
        raise NotImplementedError(f"fully_shard: param_dtype_override_fn gives the parameters of one unit several "
                                  f"compute dtypes {sorted(map(str, compute))}; shard them as separate units")
    return compute.pop() if compute else None


def _shard(slots, sources, specs, compute_dtype, mp_policy, dp_mesh, offload: bool, pin: bool):
    """Keep this rank's piece of each parameter in the unit's buffers and put it in the module as a
    sharded ``nn.Parameter`` (None: the unit has no parameters)."""
    if not slots:
        return None
    D, me = dp_mesh.size(), dp_mesh._coord[0]
    orig = slots[0].orig_dtype
    device = _compute_device(dp_mesh, offload, sources[0])
    buffers = UnitBuffers(slots, orig, compute_dtype, mp_policy.grad_reduce_dtype(orig), device,
                          shard_device=torch.device("cpu") if offload else None, pin_memory=pin)
    for s, src, spec in zip(slots, sources, specs):
        if s.dim != REPLICATED:
            off, n = chunk_bounds(src.shape[s.dim], D, me)
            src = src.narrow(s.dim, off, n)
        local = buffers.hold_piece(s, src)
        s.sharded = nn.Parameter(DTensor(local, spec), requires_grad=s.requires_grad)
        s.sharded._local_tensor = local
        s.full_param = buffers.full_param(s)
        for owner, pname in s.owners():
            owner._parameters[pname] = s.sharded
    buffers.free_full()
    return buffers


def _install(roots, unit) -> None:
    """Make each root an FSDPModule of ``unit``, gathering around its forward."""
    for m in roots:
        m._fsdp_unit = unit
        cls = m.__class__
        m.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        m.register_forward_pre_hook(pre_forward, with_kwargs=True)
        m.register_forward_hook(post_forward, with_kwargs=True)
