"""Whole-tensor ops: copies, conversions, fills and tensor factories from a tensor.

Three families, by how the output depends on the input:

* copies (clone, detach, _to_copy, copy_): the output holds the input's values, so it
  keeps the input's layout; a Partial passes only where the copy commutes with the
  reduction (a dtype cast to an integer type does not: sum of truncations is not the
  truncation of the sum);
* fills (zero_, fill_, *_like): the values do not depend on the input, only the shape,
  so the input never needs to move. Filling ``v`` on every rank of a ``P(sum)`` tensor
  would mean ``k * v``; the functional forms give Replicate instead, and in-place ``fill_``
  (which cannot change its target's layout) stays ``P(sum)`` with ``v`` on the first rank
  of each summing mesh dim and zeros on the others (as Replicate -> Partial is laid out).
  torch keeps the placement too but writes ``v`` everywhere, reading as ``k * v``.
  ``zero_`` is fine on any Partial;
* factories with a global size (new_zeros, new_empty, ...): every rank makes the whole
  tensor, so the output is Replicate (correct; each rank pays the full memory), except
  when the size is the input's own shape: then the output takes the input's shards.

Rules list one option per possible input placement so the one matching the input costs
nothing; the engine picks it per mesh dim.
"""
from __future__ import annotations

import torch

from shardprop.dispatch.registry import register_local_call, rule
from shardprop.tensor.placement import REDUCE_OPS, Partial, Replicate, Shard, partial_fill
from shardprop.tensor.spec import DTensorSpec

aten = torch.ops.aten
R = Replicate()
PARTIALS = tuple(Partial(op) for op in REDUCE_OPS)
# Reductions of a value repeated on every rank that do not give the value back (n * v, v ** n).
_NOT_IDEMPOTENT = ("sum", "product")

COPIES = [aten.clone, aten.detach, aten._to_copy]
COPY_INTO = [aten.copy, aten.copy_]
ZEROS = [aten.zero, aten.zero_]
FILLS = [aten.fill, aten.fill_]
LIKE = [aten.zeros_like, aten.ones_like, aten.full_like, aten.empty_like]
NEW = [aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full, aten.new_empty_strided]


def _placements(ndim: int) -> list:
    """Every placement a tensor of ``ndim`` dims can have on one mesh dim."""
    return [Shard(d) for d in range(ndim)] + [R, *PARTIALS]


def _partial_survives_cast(p: Partial, src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether converting each rank's partial value from ``src`` to ``dst`` commutes with ``p``'s reduction.

    Sum/avg: linear, so only into floating/complex types (rounding aside). Max/min: any
    monotone conversion, i.e. real to floating point.

    Example:
        >>> _partial_survives_cast(Partial("sum"), torch.float32, torch.int64)
        False
    """
    if p.reduce_op in ("sum", "avg"):
        return dst.is_floating_point or dst.is_complex
    return dst.is_floating_point and not src.is_complex


@rule(*COPIES)
def copy_like(ctx):
    """The output keeps the input's layout (Partial only where the dtype cast allows)."""
    x = ctx.specs[0]
    dst = ctx.out_metas[0].dtype
    return [((p,), (p,)) for p in _placements(x.ndim)
            if type(p) is not Partial or _partial_survives_cast(p, x.dtype, dst)]


@rule(*COPY_INTO)
def copy_into(ctx):
    """self's layout stays; src is brought to it (broadcast dims of src replicated)."""
    me = ctx.args[0]
    src = ctx.args[1]
    src_is_dt = type(src) is DTensorSpec
    options = []
    for p in _placements(me.ndim):
        if type(p) is Partial:
            if src_is_dt:
                ok = _partial_survives_cast(p, src.dtype, me.dtype)
            else:  # a plain scalar lands whole on every rank: only reductions that keep a repeated value
                ok = p.reduce_op not in _NOT_IDEMPOTENT
            if not ok:
                continue
        ins = (p,)
        if src_is_dt:
            ins += (_src_placement(p, src.shape, me.shape),)
        options.append((ins, (p,)))
    if src_is_dt and ctx.returns != "self":
        # Functional copy: self gives only shape and dtype, and a whole-shaped self (R or
        # Partial) takes src's values as they are laid out, Partial included.
        for p in _placements(me.ndim):
            if type(p) is Shard:
                continue
            for q in [R] + [x for x in PARTIALS if _partial_survives_cast(x, src.dtype, me.dtype)]:
                if p != q:
                    options.append(((p, q), (q,)))
    return options


def _src_placement(p, src_shape, out_shape):
    """Where src must be for self to be at ``p``: shard its aligned dim, unless broadcast."""
    if type(p) is not Shard:
        return p
    i = p.dim - (len(out_shape) - len(src_shape))
    if i < 0 or src_shape[i] != out_shape[p.dim]:
        return R
    return Shard(i)


@rule(*ZEROS)
def zero(ctx):
    """Zeros in any layout are zeros: every reduction of zeros is zero."""
    return [((p,), (p,)) for p in _placements(ctx.specs[0].ndim)]


@rule(*FILLS)
def fill(ctx):
    """Every rank writes the value (shards, Replicate, avg/max/min Partials); P(sum)/P(product): see _fill_once."""
    in_place = ctx.returns == "self"
    value = () if len(ctx.specs) == 1 else (R,)  # fill_.Tensor: a 0-dim DTensor value, replicated
    options = []
    for p in _placements(ctx.args[0].ndim):
        # P(sum)/P(product): in place, the value on one rank and the reduction's identity elsewhere
        # (_fill_once); a functional fill holds it whole everywhere
        summed = type(p) is Partial and p.reduce_op in _NOT_IDEMPOTENT
        out = R if summed and not in_place else p
        options.append(((p,) + value, (out,)))
    return options


def _fill_once(op, out, largs, lkwargs):
    """fill_ on a ``P(sum)``/``P(product)`` target: the value where this rank is first on every such mesh
    dim, the reduction's identity (0 or 1) elsewhere."""
    spec = out.out_specs[0]
    held = partial_fill(spec.placements, spec.mesh._coord)
    if held is not None:
        return largs[0].fill_(held)
    return op(*largs, **lkwargs)


register_local_call(aten.fill_, _fill_once)


@rule(*LIKE)
def like(ctx):
    """Shape-only: shards and Replicate follow the input; a Partial input gives Replicate."""
    return [((p,), (R if type(p) is Partial else p,)) for p in _placements(ctx.specs[0].ndim)]


@rule(*NEW)
def new(ctx):
    """A new tensor of a given global size: Replicate, made whole on every rank; but when the
    size is ``self``'s own shape a shard of ``self`` gives the matching shard (autograd makes
    gradient buffers this way, so a gradient keeps its parameter's layout)."""
    me = ctx.specs[0]
    same = tuple(ctx.args[1]) == tuple(me.shape)
    return [((p,), (p if same and type(p) is Shard else R,)) for p in _placements(me.ndim)]


def _local_strides(shape, stride) -> list:
    """Contiguous strides for ``shape`` in the dim order that ``stride`` lays out (outermost first).

    Example:
        >>> _local_strides((2, 3), (1, 4))   # a transposed layout stays transposed
        [1, 2]
    """
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], -d))
    out, step = [0] * len(shape), 1
    for d in reversed(order):
        out[d] = step
        step *= max(shape[d], 1)
    return out


def _new_local(op, out, largs, lkwargs):
    """Sharded output (size == self's shape): this rank's piece has self's local shape."""
    if not any(type(p) is Shard for p in out.out_specs[0].placements):
        return op(*largs, **lkwargs)
    local = list(largs)
    local[1] = list(largs[0].shape)
    if op is aten.new_empty_strided.default:
        local[2] = _local_strides(local[1], largs[2])
    return op(*local, **lkwargs)


for _packet in NEW:
    register_local_call(_packet, _new_local)
