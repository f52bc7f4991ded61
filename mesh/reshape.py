"""Meshes built from other meshes, as torch's private DeviceMesh API builds them.

``mesh._flatten(name)`` (dims as one), ``mesh._unflatten(dim, sizes, names)`` (one dim as several),
``DeviceMesh._concatenate(meshes)`` (the dims of several meshes as one mesh), and slicing a root by
the name of a dim flattened from it (``root["dp_shard_cp"]``). torchtitan builds every mesh this way.

Each result is placed by its :class:`~shardprop.mesh.layout.MeshLayout` in the universe of the mesh
it came from. Flattening and unflattening create the groups of their new dims as a mesh does (on
real backends every rank creates every group, one order; on the fake backend only its own) and reuse
the groups that exist for the same ranks; concatenating creates none, as torch's does not.
This module receives the mesh class from its argument: it never imports device_mesh.py (which
imports it).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from shardprop.mesh import groups as _groups
from shardprop.mesh.layout import MeshLayout

BackendConfig = Tuple[Optional[str], object]  # (backend name or None, c10d options or None)


def root_of(mesh):
    """The mesh ``mesh`` was ultimately sliced, flattened or unflattened from (itself for a root).

    Example:
        >>> root_of(mesh["tp"]) is mesh  # doctest: +SKIP
        True
    """
    while mesh._parent is not None:
        mesh = mesh._parent
    return mesh


def same_universe(a, b) -> bool:
    """Whether two meshes' layouts index one universe of ranks (so their dims can combine).

    Example:
        >>> same_universe(world._unflatten(0, (2, 2), ("dp", "tp"))["tp"], init_device_mesh("cpu", (4,)))  # doctest: +SKIP
        True
    """
    return a._rank_map is b._rank_map or torch.equal(a._rank_map, b._rank_map)


def full_ranks(mesh) -> torch.Tensor:
    """Every copy of ``mesh`` in its universe, as world ranks: shape ``(copies, *mesh.shape)``.

    ``mesh["tp"]`` of a (2, 2) root gives ``[[0, 1], [2, 3]]``: the groups that creating its dim takes.

    Example:
        >>> full_ranks(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"]).tolist()  # doctest: +SKIP
        [[0, 2], [1, 3]]
    """
    return mesh._rank_map[mesh._layout.positions(mesh._rank_map.numel())]


def normalize_backend_override(override, ndim: int, names: Sequence[str] = ()) -> List[BackendConfig]:
    """``backend_override`` (a dict by dim name or index) as one (backend, options) per dim, as torch's.

    A value is a backend name, c10d options, or a (name, options) pair.

    Example:
        >>> normalize_backend_override({"pp": "fake"}, 2, ("pp", "tp"))
        [('fake', None), (None, None)]
    """
    if override is None:
        return [(None, None)] * ndim
    if not isinstance(override, dict):
        raise TypeError(f"backend_override: expected a dict from dim name or index to a backend, got {override!r}")
    left = dict(override)
    out = []
    for d in range(ndim):
        name = names[d] if d < len(names) else None
        if name is not None and name in left:
            if d in left:
                raise RuntimeError(f"Found redundant dim index {d} and name {name} in backend_override")
            val = left.pop(name)
        elif d in left:
            val = left.pop(d)
        else:
            out.append((None, None))
            continue
        out.append(_one_override(val))
    if left:
        raise RuntimeError(f"Found invalid keys in backend_override: got {list(left)}, expected integers in range "
                           f"[0, {ndim}) or one of {tuple(names)}")
    return out


def _one_override(val) -> BackendConfig:
    if val is None or isinstance(val, str):
        return (val, None)
    if isinstance(val, tuple) and len(val) == 2:
        return val
    return (None, val)  # c10d options alone


def _build(like, layout: MeshLayout, rank_map: torch.Tensor, names, parent, inherited: Dict[tuple, tuple],
           overrides: Dict[int, BackendConfig], create: bool):
    """A mesh of ``like``'s class over one copy of ``layout`` (the one holding this rank).

    ``inherited``: new dims -> the (group, ranks) they keep. Other sets of dims get a group that
    exists for their ranks; with ``create`` a missing one is created (collectively, every rank the
    same lists in the same order on real backends; only this rank's on the fake backend), else skipped.
    ``overrides``: a new single dim's (backend, options).
    """
    if not layout.orthogonal():
        raise RuntimeError(f"DeviceMesh: the layout {layout} has overlapping dims (some rank would appear twice)")
    full = rank_map[layout.positions(rank_map.numel())]  # (copies, *sizes)
    me = dist.get_rank()
    hit = (full.flatten(1) == me).any(1).nonzero()
    mesh_t = full[int(hit[0])] if len(hit) else full[0]  # a rank outside still takes part in creating groups
    coord = tuple((mesh_t == me).nonzero()[0].tolist()) if len(hit) else None
    backend = _groups.backend_for(like.device_type)
    own_only = _groups.own_groups_only(backend)
    built = {}
    for dims in _groups.combos(layout.__len__()):
        if dims in inherited:
            built[dims] = inherited[dims]
            continue
        mine = _groups.my_list(mesh_t, coord, dims) if coord is not None else []
        if not create:
            group = _groups.lookup(backend, mine) if mine else None
            if group is None and len(dims) > 1:
                continue
        elif own_only:  # the fake world: every group is fake already, overrides change nothing
            group = _groups.create_group(mine, backend) if mine else None
        else:
            be, options = overrides.get(dims[0], (None, None)) if len(dims) == 1 else (None, None)
            lists = _groups.rank_lists(full, tuple(d + 1 for d in dims))  # every copy's lists, in one order
            group = _groups.create_groups(lists, be or backend, named=be is not None, options=options)
        built[dims] = (group, mine)
    return type(like)(like.device_type, mesh_t, names, _parent=parent, _layout=layout, _rank_map=rank_map,
                      _built_groups=built)


def flatten(mesh, mesh_dim_name: Optional[str] = None, backend_override=None):
    """``mesh._flatten(name)``: a 1-d mesh over all of ``mesh``'s dims (adjacent or not in the root),
    registered on the root so that ``root[name]`` slices it.

    Every rank calls it (it creates the new dim's groups). Flattening again under the same name
    returns the same mesh; a 1-d mesh flattened to its own name is itself.

    Example:
        >>> m = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))  # doctest: +SKIP
        >>> m["dp", "tp"]._flatten("dp_tp").mesh.tolist()  # on rank 0  # doctest: +SKIP
        [0, 1, 4, 5]
    """
    names = mesh.mesh_dim_names
    if not names:
        raise RuntimeError("Cannot flatten a DeviceMesh without mesh_dim_names!")
    name = mesh_dim_name or "_".join(names)
    if mesh.ndim == 1 and name in names:
        return mesh
    root = root_of(mesh)
    if root.mesh_dim_names and name in root.mesh_dim_names:
        raise ValueError(f"_flatten: {name!r} already names a dim of the root mesh {root}; choose another name")
    layout = mesh._layout.collapse()
    known = root._flattened.get(name)
    if known is not None:
        if known._layout == layout and same_universe(known, mesh):
            return known
        raise ValueError(f"_flatten: a mesh dim {name!r} was flattened from {root} before, over other dims "
                         f"({known._layout}, now {layout}); choose another name")
    (override,) = normalize_backend_override({0: backend_override} if backend_override is not None else None, 1)
    inherited = {(0,): mesh._groups[(0,)]} if mesh.ndim == 1 and (0,) in mesh._groups else {}
    flat = _build(mesh, layout, mesh._rank_map, (name,), root, inherited, {0: override}, create=True)
    root._flattened[name] = flat
    return flat


def unflatten(mesh, dim, mesh_sizes: Sequence[int], mesh_dim_names: Sequence[str], backend_override=None):
    """``mesh._unflatten(dim, sizes, names)``: dim ``dim`` split row-major into dims of ``sizes``.

    Every rank calls it (it creates the new dims' groups; ``backend_override`` by new dim name or
    index: a backend name such as ``"fake"`` for a dim nobody communicates over, c10d options, or both).
    The other dims keep their groups.

    Example:
        >>> world = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))  # doctest: +SKIP
        >>> world._unflatten(0, (2, 2, 2), ("dp", "cp", "tp")).mesh.tolist()  # doctest: +SKIP
        [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    """
    if isinstance(dim, str):
        if not mesh.mesh_dim_names or dim not in mesh.mesh_dim_names:
            raise ValueError(f"dim {dim} specified in `_unflatten` is not in {mesh.mesh_dim_names}")
        dim = mesh.mesh_dim_names.index(dim)
    elif not 0 <= dim < mesh.ndim:
        raise ValueError(f"dim {dim} specified in `_unflatten` is out of range {mesh.ndim}")
    sizes, new_names = tuple(int(s) for s in mesh_sizes), tuple(mesh_dim_names)
    if len(sizes) != len(new_names):
        raise RuntimeError("mesh_dim_names must have same length as mesh_sizes in _unflatten!")
    k = len(sizes)
    layout = mesh._layout.split(dim, sizes)
    old = mesh.mesh_dim_names or tuple(f"dim_{d}" for d in range(mesh.ndim))
    names = old[:dim] + new_names + old[dim + 1:]
    overrides = {dim + i: cfg for i, cfg in enumerate(normalize_backend_override(backend_override, k, new_names))}
    # An old dim keeps its group; it moves by k - 1 places when after the split one.
    inherited = {(d if d < dim else d + k - 1,): mesh._groups[(d,)]
                 for d in range(mesh.ndim) if d != dim and (d,) in mesh._groups}
    return _build(mesh, layout, mesh._rank_map, names if mesh.mesh_dim_names else None, mesh, inherited,
                  overrides, create=True)


def concatenate(meshes) -> object:
    """``DeviceMesh._concatenate(meshes)``: one mesh whose dims are the given meshes' dims, in order.

    The meshes must share a universe (any meshes over the same ranks do: slices of two root meshes
    built over one world combine) and their dims must not overlap. No group is created: each dim
    keeps its mesh's group.

    Example:
        >>> dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"]  # doctest: +SKIP
        >>> tp = world._unflatten(0, (2, 2), ("x", "tp"))["tp"]  # another root over the same ranks  # doctest: +SKIP
        >>> DeviceMesh._concatenate([dp, tp]).mesh.tolist()  # doctest: +SKIP
        [[0, 1], [2, 3]]
    """
    meshes = list(meshes)
    if not meshes:
        raise ValueError("_concatenate: expects at least one DeviceMesh")
    first = meshes[0]
    for m in meshes[1:]:
        if not same_universe(first, m):
            raise RuntimeError(f"Cannot concatenate DeviceMeshes derived from different device meshes: {first} "
                               f"and {m} index different sets of ranks ({first._rank_map.tolist()} and "
                               f"{m._rank_map.tolist()})")
        if m.device_type != first.device_type:
            raise RuntimeError(f"_concatenate: meshes of device types {first.device_type!r} and {m.device_type!r}")
    layout = MeshLayout.concat([m._layout for m in meshes])
    if not layout.orthogonal() or layout.complement(first._rank_map.numel()) is None:
        raise RuntimeError(f"Cannot concatenate overlapping meshes: {meshes} (layout {layout})")
    names = None
    if all(m.mesh_dim_names for m in meshes):
        names = tuple(n for m in meshes for n in m.mesh_dim_names)
    inherited, at = {}, 0
    for m in meshes:
        for d in range(m.ndim):
            if (d,) in m._groups:
                inherited[(at + d,)] = m._groups[(d,)]
        at += m.ndim
    return _build(first, layout, first._rank_map, names, root_of(first), inherited, {}, create=False)


def slice_flattened(root, names: Tuple[str, ...]):
    """``root[names]`` where some names are dims flattened from ``root`` (torch allows it on a root only).

    Example:
        >>> mesh["dp", "cp"]._flatten("dp_cp"); mesh["dp_cp"] is mesh["dp", "cp"]._flatten("dp_cp")  # doctest: +SKIP
        True
    """
    if len(names) == 1:
        return root._flattened[names[0]]
    parts = [root._flattened[n] if n in root._flattened else root[n] for n in names]
    return concatenate(parts)


def flattened_group(mesh, name: str):
    """The group of the dim flattened from ``mesh``'s root under ``name`` (torch's ``get_group`` looks there
    too), or None when there is none.

    Example:
        >>> flattened_group(mesh["tp"], "dp_cp")  # doctest: +SKIP
    """
    flat = root_of(mesh)._flattened.get(name)
    return flat.get_group(0) if flat is not None else None
