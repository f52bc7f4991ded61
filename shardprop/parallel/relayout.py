"""The two layout changes of sequence parallelism, done directly: even 1-d ``S(d) -> R`` and ``P -> S(d)``.

Tensor-parallel styles move activations between a sequence-sharded and a replicated or
partial layout several times per block (all-gather before attention and the MLP,
reduce-scatter after them, and the same in backward). On a 1-d mesh whose size divides
the sharded dim, each is one flat collective plus one layout copy, exactly what a
hand-written implementation does; this module does that without the general planner
(``shardprop.tensor.redistribute``), which plans for uneven shards, several mesh dims
and async results and costs a few tens of microseconds more per call. Any other
transition, an async or traced tensor, or a non-sum partial returns None here
(``relayout``) or takes ``DTensor.redistribute`` (``redistribute``), so the caller keeps
the general path. Results are the same tensors the planner gives (same values, contiguous
layout); collectives go through ``shardprop.mesh.collectives`` (``comm_counter`` counts them).

Example:
    >>> local = relayout(y, spec_partial, (Shard(1),))  # a reduce-scatter onto the sequence  # doctest: +SKIP
    >>> x = redistribute(x_seq, (Replicate(),))  # a DTensor: all-gather of the sequence  # doctest: +SKIP
"""
from __future__ import annotations

import math

import torch

from shardprop.mesh import buffer_pool
from shardprop.mesh import collectives as C
from shardprop.parallel.autograd_apply import direct_apply
from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.placement import Partial, Replicate, Shard
from shardprop.tensor.redistribute import redistribute_local

_is_compiling = torch.compiler.is_compiling
_DIM0 = (0,)
_GATHER, _SCATTER = 1, 2

# (source spec, target placements) -> (kind, tensor dim, mesh size), or None when not covered.
# Specs are interned, so the key hashes by identity.
_how: dict = {}
_MAX_KEYS = 4096


def _classify(spec, dst: tuple):
    mesh = spec.mesh
    if mesh.ndim != 1 or len(dst) != 1 or spec.is_symbolic:
        return None
    n = mesh.shape[0]
    src, want = spec.placements[0], dst[0]
    if type(src) is Shard and type(want) is Replicate:
        kind, d = _GATHER, src.dim
    elif type(src) is Partial and src.reduce_op == "sum" and type(want) is Shard:
        kind, d = _SCATTER, want.dim
    else:
        return None
    if spec.shape[d] % n:
        return None  # uneven shards: the planner pads and trims
    return kind, d, n


def _lookup(spec, dst: tuple):
    key = (spec, dst)
    try:
        return _how[key]
    except KeyError:
        pass
    if len(_how) >= _MAX_KEYS:
        _how.clear()
    how = _how[key] = _classify(spec, dst)
    return how


def gather(t: torch.Tensor, mesh, d: int, n: int) -> torch.Tensor:
    """Every rank's equal piece of dim ``d`` joined along it: one flat all-gather, one layout copy if ``d`` is inner.

    Example:
        >>> gather(torch.ones(2, 3, 4), mesh, 1, 4).shape  # 4 ranks  # doctest: +SKIP
        torch.Size([2, 12, 4])
    """
    t = t.contiguous()
    buf = C.all_gather(t, mesh, _DIM0)
    shape = list(t.shape)
    full = shape[:d] + [n * shape[d]] + shape[d + 1:]
    if math.prod(shape[:d]) == 1:  # the pieces are already in order in the buffer
        return buf.view(full)
    out = buffer_pool.empty(full, t)
    out.view(shape[:d] + [n] + shape[d:]).copy_(buf.view([n] + shape).movedim(0, d))
    return out


def scatter(t: torch.Tensor, mesh, d: int, n: int) -> torch.Tensor:
    """This rank's piece of dim ``d`` of the sum over ranks: one layout copy if ``d`` is inner, one reduce-scatter.

    Example:
        >>> scatter(torch.ones(2, 12, 4), mesh, 1, 4).shape  # 4 ranks  # doctest: +SKIP
        torch.Size([2, 3, 4])
    """
    shape = list(t.shape)
    c = shape[d] // n
    pre = shape[:d]
    if math.prod(pre) == 1:
        buf = t.contiguous()
    else:  # the n chunks of dim d stacked first, so each rank's piece is one contiguous slice
        stacked = t.reshape(pre + [n, c] + shape[d + 1:]).movedim(d, 0)
        buf = buffer_pool.empty(stacked.shape, t)
        buf.copy_(stacked)
    out = C.reduce_scatter(buf.view(n, -1), mesh, _DIM0)
    return out.view(pre + [c] + shape[d + 1:])


def relayout(local: torch.Tensor, spec, dst: tuple):
    """``local`` (this rank's piece of ``spec``) laid out as ``dst``, if this module covers it; else None.

    Example:
        >>> out = relayout(x, spec, (Replicate(),)) or redistribute_local(x, spec, (Replicate(),))  # doctest: +SKIP
    """
    how = _lookup(spec, dst)
    if how is None or type(local) is not torch.Tensor:
        return None
    kind, d, n = how
    if kind == _GATHER:
        return gather(local, spec.mesh, d, n)
    return scatter(local, spec.mesh, d, n)


def relayout_or_plan(local: torch.Tensor, spec, dst: tuple) -> torch.Tensor:
    """:func:`relayout`, or the general planner (``redistribute_local``) where it does not apply."""
    out = relayout(local, spec, dst)
    return redistribute_local(local, spec, dst) if out is None else out


class _Redistribute(torch.autograd.Function):
    """``DTensor.redistribute`` for the covered transitions; backward: the gradient back to the source layout."""

    @staticmethod
    def forward(ctx, dt, dst):
        src = dt._spec
        ctx.src = src
        return DTensor(relayout(dt._local_tensor, src, dst), src.with_placements(dst), requires_grad=False)

    @staticmethod
    def backward(ctx, grad):
        # The source is Shard (a covered transition), so the gradient goes back to the same Shard:
        # from Partial a reduce-scatter, from Replicate a local chunk (the planner's), as is from Shard.
        src = ctx.src
        if grad._spec.placements != src.placements:
            gs = grad._spec
            grad = DTensor(relayout_or_plan(grad._local_tensor, gs, src.placements), gs.with_placements(src.placements))
        return grad, None


_redistribute = direct_apply(_Redistribute)


def redistribute(x: DTensor, dst: tuple) -> DTensor:
    """``x.redistribute(placements=dst)`` (normalized placements), directly for the covered transitions.

    Example:
        >>> redistribute(x_seq, (Replicate(),)).placements  # doctest: +SKIP
        (Replicate(),)
    """
    src = x._spec
    if _is_compiling() or type(x._local_tensor) is not torch.Tensor or _lookup(src, dst) is None \
            or type(src.placements[0]) is not Shard:
        return x.redistribute(placements=dst)
    if x.requires_grad and torch.is_grad_enabled():
        return _redistribute(x, dst)
    return DTensor(relayout(x._local_tensor, src, dst), src.with_placements(dst), requires_grad=False)


__all__ = ["gather", "scatter", "relayout", "relayout_or_plan", "redistribute"]
