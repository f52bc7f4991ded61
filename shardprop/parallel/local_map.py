"""``local_map``: run a function written for plain tensors on DTensors' local shards.

Mirrors ``torch.distributed.tensor.experimental.local_map`` (torch 2.15 signature). On the way in,
each DTensor argument's placements are checked against ``in_placements`` (or redistributed to
them with ``redistribute_inputs=True``) and replaced by its local shard (differentiably, with
``in_grad_placements`` saying how the gradient of the shard is laid out); on the way out, each
tensor result is wrapped with its ``out_placements`` entry (``DTensor.from_local``, no check).

Two differences from the reference: mismatches raise ``ValueError``/``TypeError`` that name the
function, the argument's position and both placements (the reference raises ``AssertionError`` for
several of them), and ``spmd_types=True`` (the reference's optional type checker, a separate
package) is refused with a clear error. As in the reference, outputs are taken to be evenly
sharded (their global shape is the local shape times the mesh size along Shard dims).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch.utils import _pytree as pytree

from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.placement import Shard


def local_map(func: Optional[Callable] = None, out_placements=None, in_placements=None, in_grad_placements=None,
              device_mesh=None, *, redistribute_inputs: bool = False, spmd_types: bool = False):
    """Wrap ``func`` (on plain tensors) to take and return DTensors; usable as a decorator (``func=None``).

    ``out_placements``: one placement sequence per flattened output (a single one when there is one
    output; ``None`` for non-tensor outputs). ``in_placements``: one per flattened positional input
    (``None`` for non-tensors); ``None`` skips the check. ``in_grad_placements``: the layout of each
    input shard's gradient (default: the input's placements). ``device_mesh``: the outputs' mesh
    (default: the first DTensor input's). Without any DTensor input, ``func`` runs as is.

    Example:
        >>> def local_mm(w, x):  # w: columns, x: rows -> a partial sum on each rank
        ...     return torch.mm(w, x)
        >>> mm = local_map(local_mm, out_placements=[Partial()], in_placements=([Shard(1)], [Shard(0)]))  # doctest: +SKIP
        >>> mm(w_dt, x_dt).full_tensor()  # == w @ x  # doctest: +SKIP
    """
    if spmd_types:
        raise NotImplementedError("local_map(spmd_types=True): shardprop has no SPMD type checker; "
                                  "call local_map without spmd_types")
    if func is None:
        return functools.partial(local_map, out_placements=out_placements, in_placements=in_placements,
                                 in_grad_placements=in_grad_placements, device_mesh=device_mesh,
                                 redistribute_inputs=redistribute_inputs)
    return functools.partial(_local_map_wrapped, func, out_placements, in_placements, in_grad_placements,
                             device_mesh, redistribute_inputs)


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _normalized(func, what: str, idx: int, spec, arg) -> tuple:
    """``spec`` with negative Shard dims made non-negative; checked against the mesh.

    Written out rather than ``normalize_placements``: torch.compile traces this, and dynamo cannot
    read a mesh's attributes (it holds the mesh as an opaque value): the mesh's ndim is the
    number of the argument's placements.
    """
    spec = tuple(spec)
    ndim = len(arg.placements)
    if len(spec) != ndim:
        raise ValueError(f"local_map({_name(func)}): {what}[{idx}] has {len(spec)} placements {list(spec)} "
                         f"for a {ndim}-d mesh")
    return tuple(Shard(p.dim + arg.ndim) if type(p) is Shard and p.dim < 0 else p for p in spec)


def _local_input(func, idx, arg, spec, grad_spec, redistribute_inputs):
    """The local shard of DTensor argument ``idx`` after its placements are checked (or moved)."""
    if spec is not None:
        want = _normalized(func, "in_placements", idx, spec, arg)
        if arg.placements != want:
            if not redistribute_inputs:
                raise ValueError(
                    f"local_map({_name(func)}): input {idx} is laid out as {list(arg.placements)} but "
                    f"in_placements[{idx}] is {list(want)}; pass redistribute_inputs=True to redistribute it")
            arg = arg.redistribute(placements=want)
    if grad_spec is not None:
        grad_spec = _normalized(func, "in_grad_placements", idx, grad_spec, arg)
    return arg.to_local(grad_placements=grad_spec)


def _local_map_wrapped(func, out_placements, in_placements, in_grad_placements, device_mesh, redistribute_inputs,
                       *args, **kwargs):
    flat, tree = pytree.tree_flatten(args)
    for what, given in (("in_placements", in_placements), ("in_grad_placements", in_grad_placements)):
        if given is not None and len(given) != len(flat):
            raise ValueError(f"local_map({_name(func)}): {what} has {len(given)} entries for {len(flat)} "
                             "flattened positional inputs; give one per input (None for non-tensors)")
    local_flat, seen = [], False
    for idx, arg in enumerate(flat):
        spec = in_placements[idx] if in_placements is not None else None
        if isinstance(arg, DTensor):
            if device_mesh is None:  # an explicit device_mesh names the outputs' mesh; inputs keep their own
                device_mesh = arg.device_mesh
            seen = True
            if in_placements is not None and spec is None:
                raise ValueError(f"local_map({_name(func)}): input {idx} is a DTensor laid out as "
                                 f"{list(arg.placements)} but in_placements[{idx}] is None")
            grad_spec = in_grad_placements[idx] if in_grad_placements is not None else None
            if in_grad_placements is not None and grad_spec is None:
                raise ValueError(f"local_map({_name(func)}): input {idx} is a DTensor but in_grad_placements[{idx}] is None")
            local_flat.append(_local_input(func, idx, arg, spec, grad_spec, redistribute_inputs))
        else:
            if spec is not None and not isinstance(arg, torch.Tensor):
                raise ValueError(f"local_map({_name(func)}): input {idx} is a {type(arg).__name__}, not a tensor, "
                                 f"but in_placements[{idx}] is {list(spec)}; give None for it")
            local_flat.append(arg)
    out = func(*pytree.tree_unflatten(local_flat, tree), **kwargs)
    if not seen:  # no DTensor went in: plain torch, as in the reference
        return out
    flat_out, out_tree = pytree.tree_flatten(out)
    specs = out_placements if isinstance(out_placements, tuple) else (out_placements,)
    if len(specs) != len(flat_out):
        raise ValueError(f"local_map({_name(func)}): out_placements gives {len(specs)} entries for "
                         f"{len(flat_out)} flattened outputs; give one per output (None for non-tensors)")
    wrapped = []
    for idx, (o, spec) in enumerate(zip(flat_out, specs)):
        if isinstance(o, DTensor):
            raise TypeError(f"local_map({_name(func)}): output {idx} is a DTensor; the function must return "
                            "plain (local) tensors")
        if isinstance(o, torch.Tensor):
            if spec is None:
                raise ValueError(f"local_map({_name(func)}): output {idx} is a tensor but out_placements[{idx}] is None")
            wrapped.append(DTensor.from_local(o, device_mesh, tuple(spec), run_check=False))
        else:
            if spec is not None:
                raise ValueError(f"local_map({_name(func)}): output {idx} is a {type(o).__name__}, not a tensor, "
                                 f"but out_placements[{idx}] is {list(spec)}; give None for it")
            wrapped.append(o)
    return pytree.tree_unflatten(wrapped, out_tree)


__all__ = ["local_map"]
