"""Collectives along one mesh dim (or a set of mesh dims), sync or async.

All of them work on dim 0 of one contiguous buffer: all-gather writes every
rank's piece into one output, reduce-scatter reads every piece from one input,
all-to-all sends dim-0 slices. Callers lay tensors out so that no flatten or
unflatten copy is needed (redistribute.py does that). With ``async_op=True``
each returns an :class:`AsyncTensor` that waits on first use.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from shardprop.mesh.async_tensor import AsyncTensor, wait_all

# torch 2.13 names the single-buffer collectives *_single and warns on the old
# names; older torch has only the old names. Resolve once, at import.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}

MeshDims = Union[int, str, Tuple[int, ...]]


def resolve(mesh, dims: MeshDims):
    """(group, ranks of this rank's group, group size) along ``dims`` of ``mesh``.

    Example:
        >>> group, ranks, n = resolve(mesh, "tp")  # doctest: +SKIP
    """
    if not isinstance(dims, tuple):
        dims = (mesh.dim_index(dims),)
    entry = mesh.group_for(dims)
    if entry is None or entry[0] is None:
        raise RuntimeError(f"shardprop: no process group for mesh dims {dims} of {mesh} on this rank")
    group, ranks = entry
    return group, ranks, len(ranks)


def _finish(out: torch.Tensor, work, async_op: bool, after=None, shape=None):
    """Return the result now, or an AsyncTensor that runs ``after`` once the work is done."""
    if async_op:
        return AsyncTensor(work, out, after, shape)
    return after(out) if after is not None else out


def _then(first, second):
    if first is None:
        return second
    if second is None:
        return first
    return lambda t: second(first(t))


def _avg(n: int):
    return lambda t: t.div_(n)


def all_gather(t: torch.Tensor, mesh, dims: MeshDims, *, async_op: bool = False, finish=None,
               finish_shape=None) -> torch.Tensor:
    """Gather equal-sized pieces along dim 0 into one new contiguous tensor.

    Example:
        >>> all_gather(torch.ones(2, 3), mesh, 0).shape  # 4 ranks  # doctest: +SKIP
        torch.Size([8, 3])
    """
    group, _, n = resolve(mesh, dims)
    t = wait_all(t).contiguous()
    out = t.new_empty((n * t.shape[0],) + tuple(t.shape[1:])) if t.ndim else t.new_empty((n,))
    work = _all_gather_flat(out, t, group=group, async_op=async_op)
    return _finish(out, work, async_op, finish, finish_shape)


def reduce_scatter(t: torch.Tensor, mesh, dims: MeshDims, op: str = "sum", *, async_op: bool = False, finish=None,
                   finish_shape=None) -> torch.Tensor:
    """Reduce one contiguous input across ranks and keep this rank's dim-0 piece.

    ``t.shape[0]`` must divide by the group size.

    Example:
        >>> reduce_scatter(torch.ones(8, 3), mesh, 0).shape  # 4 ranks  # doctest: +SKIP
        torch.Size([2, 3])
    """
    group, _, n = resolve(mesh, dims)
    t = wait_all(t).contiguous()
    out = t.new_empty((t.shape[0] // n,) + tuple(t.shape[1:]))
    work = _reduce_scatter_flat(out, t, op=_REDUCE_OPS[op], group=group, async_op=async_op)
    return _finish(out, work, async_op, _then(_avg(n) if op == "avg" else None, finish), finish_shape)


def all_reduce(t: torch.Tensor, mesh, dims: MeshDims, op: str = "sum", *, async_op: bool = False,
               inplace: bool = False) -> torch.Tensor:
    """All-reduce; into a fresh tensor unless ``inplace`` (when the caller owns ``t``).

    Example:
        >>> all_reduce(torch.ones(3), mesh, 0)  # 4 ranks -> tensor([4., 4., 4.])  # doctest: +SKIP
    """
    group, _, n = resolve(mesh, dims)
    t = wait_all(t)
    out = t if inplace and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)
    work = dist.all_reduce(out, op=_REDUCE_OPS[op], group=group, async_op=async_op)
    return _finish(out, work, async_op, _avg(n) if op == "avg" else None)


def all_to_all(t: torch.Tensor, mesh, dims: MeshDims, output_split_sizes: Optional[Sequence[int]] = None,
               input_split_sizes: Optional[Sequence[int]] = None, *, out: Optional[torch.Tensor] = None,
               async_op: bool = False, finish=None, finish_shape=None) -> torch.Tensor:
    """Send dim-0 slice i of ``t`` to rank i of the group; receive into one tensor.

    Split sizes count dim-0 rows; None means equal splits.

    Example:
        >>> all_to_all(torch.arange(4.), mesh, 0)  # doctest: +SKIP
    """
    group, _, n = resolve(mesh, dims)
    t = wait_all(t).contiguous()
    if out is None:
        rows = sum(output_split_sizes) if output_split_sizes is not None else t.shape[0]
        out = t.new_empty((rows,) + tuple(t.shape[1:]))
    work = dist.all_to_all_single(out, t, output_split_sizes=list(output_split_sizes) if output_split_sizes is not None else None,
                                  input_split_sizes=list(input_split_sizes) if input_split_sizes is not None else None,
                                  group=group, async_op=async_op)
    return _finish(out, work, async_op, finish, finish_shape)


def broadcast(t: torch.Tensor, mesh, dims: MeshDims, src: int = 0, *, async_op: bool = False) -> torch.Tensor:
    """Broadcast ``t`` from index ``src`` of the group (in place on ``t``).

    Example:
        >>> broadcast(t, mesh, "tp", src=0)  # doctest: +SKIP
    """
    group, ranks, _ = resolve(mesh, dims)
    t = wait_all(t)
    work = dist.broadcast(t, src=ranks[src], group=group, async_op=async_op)
    return _finish(t, work, async_op)


def scatter(chunks: Optional[List[torch.Tensor]], out: torch.Tensor, mesh, dims: MeshDims, src: int = 0, *,
            async_op: bool = False) -> torch.Tensor:
    """Scatter equal-sized ``chunks`` (given on the source only) into ``out`` on every rank.

    Example:
        >>> scatter(list(full.chunk(4)), torch.empty(2), mesh, 0)  # doctest: +SKIP
    """
    group, ranks, _ = resolve(mesh, dims)
    me = dist.get_rank()
    work = dist.scatter(out, [c.contiguous() for c in chunks] if me == ranks[src] else None,
                        src=ranks[src], group=group, async_op=async_op)
    return _finish(out, work, async_op)
