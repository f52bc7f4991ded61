"""fully_shard over parameters annotated by the ``spmd_types`` package (torchtitan's default backend).

Under ``spmd_types`` a model computes on plain tensors: each parameter is this rank's local piece,
annotated with a type per mesh axis (``R`` replicated, ``I`` invariant, ``V`` varying, with a
``PartitionSpec`` saying which tensor dim a varying axis splits). ``fully_shard(mesh,
dp_mesh_dims=...)`` reads those annotations as torch 2.15's does:

- storage: the piece as a DTensor on the whole mesh, ``Shard(d)`` on an axis the partition spec
  puts on tensor dim ``d``, ``Replicate`` on ``R``/``I`` axes, then sharded over the dp dims as
  any DTensor parameter;
- compute: the gathered piece as a plain tensor, as the model expects;
- gradients: a parameter ``R`` on a model-parallel axis gets a partial gradient there (``R``'s
  backward type is ``P``): summed over that axis before the reduce-scatter; ``I`` and ``V`` are
  complete.

The package is optional: without it (or without annotations) parameters are taken as they are.

Example:
    >>> as_storage("w", param, plan)  # doctest: +SKIP
    (DTensor on the whole mesh, (1,))  # (storage, model-parallel dims its gradient is summed over)
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def _annotations(p) -> Optional[tuple]:
    """(local types per mesh axis, partition spec) of an annotated plain tensor, else None."""
    try:
        from spmd_types import runtime
    except ImportError:
        return None
    if not runtime.has_local_type(p):
        return None
    return dict(runtime.get_local_type(p) or {}), runtime.get_partition_spec(p)


def as_storage(fqn: str, p, plan) -> Optional[Tuple[object, Tuple[int, ...]]]:
    """(``p`` as a DTensor on the plan's whole mesh, model-parallel mesh dims its gradient is summed over)
    for a plain parameter with ``spmd_types`` annotations; None for any other parameter.

    Example:
        >>> storage, summed = as_storage("attention_norm.weight", norm_weight, plan)  # doctest: +SKIP
    """
    found = _annotations(p) if not hasattr(p, "_spec") else None
    if found is None:
        return None
    import spmd_types as spmd
    from shardprop.tensor.dtensor import DTensor, make_spec
    from shardprop.tensor.placement import Replicate, Shard
    types, pspec = found
    mesh = plan.spmd_mesh
    axes = [spmd.MeshAxis.of(mesh.get_group(i)) for i in range(mesh.ndim)]
    split = {}  # mesh dim -> tensor dim it splits
    for d, entry in enumerate(pspec or ()):
        for axis in (entry if isinstance(entry, tuple) else (entry,)) if entry is not None else ():
            if axis not in axes:
                raise ValueError(f"fully_shard: parameter {fqn!r}'s spmd_types partition spec names {axis}, which is "
                                 f"not a dim of the mesh {mesh}")
            split[axes.index(axis)] = d
    placements, summed, shape = [], [], list(p.shape)
    for i, axis in enumerate(axes):
        kind = types.get(axis, spmd.R)
        if i in plan.dp_dims:
            if i in split or kind not in (spmd.R, spmd.I):
                raise ValueError(f"fully_shard: parameter {fqn!r} is {kind} on the data-parallel mesh dim "
                                 f"{mesh.mesh_dim_names[i]!r}; fully_shard owns the data-parallel reduction, so "
                                 f"it must be R there")
            placements.append(Replicate())
        elif i in split:
            placements.append(Shard(split[i]))
            shape[split[i]] *= mesh.size(i)
        elif kind in (spmd.R, spmd.I):
            placements.append(Replicate())
            if kind is spmd.R:
                summed.append(i)
        else:
            raise NotImplementedError(f"fully_shard: parameter {fqn!r} is {kind} on the mesh dim "
                                      f"{mesh.mesh_dim_names[i]!r} with no partition spec entry; shardprop takes "
                                      f"R, I, or V with a PartitionSpec there")
    local = p.detach()
    spec = make_spec(mesh, placements, torch.Size(shape), dtype=p.dtype)
    return DTensor(local, spec), tuple(summed)


__all__ = ["as_storage"]
