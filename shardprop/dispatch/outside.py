"""Ops on a rank outside a DTensor's mesh: no-ops with the right specs, as torch's DTensor runs them.

Pipeline stages live on sub-meshes, and code written for torch calls every op on every rank. A
rank outside the mesh holds an empty local tensor (``distribute_tensor``, ``from_local`` and the
factories give it one), computes nothing and communicates nothing; its results carry the same
global specs as on the mesh's ranks, over a default local tensor: ``torch.zeros(())`` for a 0-dim
output, an empty ``(0,)`` tensor otherwise (torch's ``default_tensor`` in ``_dispatch.py``).
Scalar results are ``None``, except ``equal``, which is ``True`` (see :func:`special_result`).

The decision is made once per propagation answer: the dispatcher swaps a cached answer for its
outside form (:func:`sharding_for`) in its miss path, so a mesh's own ranks pay nothing on a hit.

Example:
    >>> mesh = DeviceMesh("cpu", [0, 1])  # on every rank of 4  # doctest: +SKIP
    >>> y = distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)]) + 1  # doctest: +SKIP
    >>> y.shape, y.to_local().shape  # on rank 2  # doctest: +SKIP
    (torch.Size([6, 4]), torch.Size([0]))
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from shardprop.dispatch import propagate as _prop
from shardprop.dispatch.op_schema import OutputSharding
from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.placement import Replicate
from shardprop.tensor.spec import DTensorSpec, TensorMeta

aten = torch.ops.aten


def default_local(spec, device) -> torch.Tensor:
    """The local tensor of an output on a rank outside its mesh: zeros(()) when 0-dim, else empty (0,).

    Example:
        >>> default_local(spec_of_a_sum, torch.device("cpu"))  # doctest: +SKIP
        tensor(0.)
    """
    m = spec.tensor_meta
    if len(m.shape) == 0:
        return torch.zeros((), dtype=m.dtype, device=device)
    return torch.empty(0, dtype=m.dtype, device=device)


def _device(largs, lkwargs) -> torch.device:
    for a in largs:
        if isinstance(a, torch.Tensor):
            return a.device
        if type(a) is list:
            for x in a:
                if isinstance(x, torch.Tensor):
                    return x.device
    for a in lkwargs.values():
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def compute(op, out, largs, lkwargs):
    """The local call of every op on a rank outside its mesh: default outputs, nothing computed."""
    returns = out.returns
    if returns == "self":  # in place: the (empty) target is the result; list ops return nothing
        return largs[0] if op._schema.returns else None
    if returns in ("out", "none"):
        return None
    device = _device(largs, lkwargs)
    if returns in ("tensor", "view"):
        return default_local(out.out_specs[0], device)
    return [None if s is None else default_local(s, device) for s in out.out_specs]


def sharding_for(out: OutputSharding) -> OutputSharding:
    """``out`` as a rank outside the mesh runs it: nothing to redistribute, :func:`compute` as the local call.

    The output specs (and so placements) stay those the mesh's ranks compute.
    """
    return dataclasses.replace(out, plans=(None,) * len(out.plans),
                               needs_redistribute=False, local_call=compute, outside=True)


# Whether the op an answer is for runs on a mesh this rank is not in (asked on a cache miss only);
# propagate's own, which must not cache such an answer in its mesh form.
is_outside = _prop.runs_outside


def excluded_mesh(args, kwargs):
    """The mesh of the first DTensor among the arguments, when this rank is outside it; else None."""
    for a in args:
        if isinstance(a, DTensor):
            mesh = a._spec.mesh
            return mesh if mesh._coord is None else None
    for a in tree_leaves((args, kwargs)):
        if isinstance(a, DTensor):
            mesh = a._spec.mesh
            return mesh if mesh._coord is None else None
    return None


def special_result(op, args, kwargs, mesh):
    """What an op with a special handler gives outside its mesh, where the handler would communicate.

    ``equal`` is True: this rank holds nothing that differs (torch all-reduces the answer over the
    default group, so its outside ranks see the mesh's answer, but every rank must then call it;
    here the mesh's ranks agree among themselves and an outside rank never blocks them).
    ``item()`` raises: there is no value on this rank (torch fails there too). Other ops return
    None when the op has a rule (the caller then runs the rule path, whose outside form is a no-op),
    else :func:`shaped_like_meta`.
    """
    if op is aten.equal.default:
        return True
    if op is aten._local_scalar_dense.default:
        raise RuntimeError(f"item(): this rank is not in {mesh}, so its DTensor holds no value (it has an empty "
                           "local tensor, as in torch); read it on the mesh's ranks, or move it to a mesh with "
                           "this rank first")
    return None


def shaped_like_meta(op, args, kwargs, mesh):
    """Outputs of ``op`` (which has no rule) outside the mesh: global shapes from a run on meta tensors.

    Placements: those of the first DTensor argument where the output has its shape, else Replicate
    (the mesh's ranks compute the real ones; nothing on this rank depends on them).
    """
    first = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, DTensor))

    def meta(d):
        return torch.empty_strided(d.shape, d.stride(), dtype=d.dtype, device="meta")

    margs, mkwargs = tree_map_only(DTensor, meta, (args, kwargs or {}))
    try:
        res = op(*margs, **mkwargs)
    except Exception as e:
        raise _prop.ShardingError(
            f"{op}: this rank is not in {mesh} and cannot tell the output's shape without the values it does not "
            f"hold ({type(e).__name__}: {e}); call it on the mesh's ranks only") from e
    alias = _prop._op_alias(op)
    if alias == "self":
        return args[0] if op._schema.returns else None
    if alias == "out":
        names = _prop.written_kwargs(op)
        return kwargs[names[0]] if len(names) == 1 else tuple(kwargs[n] for n in names)
    device = first._local_tensor.device

    def wrap(t):
        pl = first._spec.placements if t.shape == first.shape else (Replicate(),) * mesh.ndim
        spec = DTensorSpec(mesh, tuple(pl), TensorMeta(t.shape, t.stride(), t.dtype))
        return DTensor(default_local(spec, device), spec)

    if isinstance(res, torch.Tensor):
        return wrap(res)
    if isinstance(res, (tuple, list)):
        return type(res)(wrap(t) if isinstance(t, torch.Tensor) else t for t in res)
    return None
