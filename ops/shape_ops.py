"""Ops that rearrange or pad a tensor: pads, repeat, rot90, unfold, diagonals, scatters into slices.

Each op leaves some input dims untouched: element ``[.., i, ..]`` of the output along
such a dim comes from element ``[.., i, ..]`` of the input, so a shard of that dim
survives (renumbered where the op adds or drops dims). The dims the op does touch
(padded, repeated, rotated, unfolded, the diagonal's pair, the scattered dim) must be
replicated. A builder per op lists the surviving dims as tuples ``(dim of each DTensor
input..., output dim)``; one rule turns them into options.

Partials: ops that only move or copy elements pass every Partial; ops that also write
zeros (diag_embed, im2col's padding, tril) pass them too, since every rank writes the same
zero where the global result has a zero (0 + 0 = 0, max(0, 0) = 0). A constant pad with an
unknown or non-zero value passes none (k ranks would add it k times). Complex results
pass only the linear ``P(sum)``/``P(avg)``.

``tril``/``triu`` keep every shard, even of the matrix dims: each rank runs the op with
its diagonal shifted by its shard's row and column offsets (``_shifted_tri``).

Example:
    >>> x = distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)])  # doctest: +SKIP
    >>> torch.nn.functional.pad(x, (1, 1)).placements   # pads dim 1 only  # doctest: +SKIP
    (Shard(dim=0),)
"""
from __future__ import annotations

import torch

from shardprop.dispatch.registry import register_local_call, rule
from shardprop.tensor.placement import Partial, Replicate, Shard

from .along_dim import arg

aten = torch.ops.aten
R = Replicate()
ALL = ("sum", "avg", "max", "min", "product")  # moves and copies of elements commute with every reduction
LINEAR = ("sum", "avg")


def _ndim(ctx, i: int = 0) -> int:
    return ctx.specs[i].ndim


def _keep_except(touched, ndim: int, n_in: int = 1) -> list:
    """(d,) * n_in + (d,) for every dim not in ``touched`` (same-rank inputs and output)."""
    return [(d,) * (n_in + 1) for d in range(ndim) if d not in touched]


def _norm(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


# ------------------------------------------------------------------ builders: ctx -> surviving dims
def _padded(name: str, n_in: int = 1):
    """Pads: a dim survives when both of its pad amounts are zero (pad lists start at the last dim)."""
    def build(ctx):
        pad, ndim = arg(ctx, name), _ndim(ctx)
        touched = {ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}
        return _keep_except(touched, ndim, n_in)
    return build


def _rot90(ctx):
    ndim = _ndim(ctx)
    return _keep_except({_norm(d, ndim) for d in arg(ctx, "dims")}, ndim)


def _repeat(ctx):
    repeats, ndim = arg(ctx, "repeats"), _ndim(ctx)
    lead = len(repeats) - ndim  # repeat adds leading dims for a longer repeats list
    return [(d, lead + d) for d in range(ndim) if repeats[lead + d] == 1]


def _unfold(ctx):  # the output gains a last dim (the window); the unfolded dim itself changes
    ndim = _ndim(ctx)
    return _keep_except({_norm(arg(ctx, "dimension"), ndim)}, ndim)


def _leading(keep_last: int):
    """Ops on the last ``keep_last`` dims (pixel shuffles): the leading (batch) dims survive."""
    def build(ctx):
        return [(d, d) for d in range(_ndim(ctx) - keep_last)]
    return build


def _channel_shuffle(ctx):  # permutes dim 1 only
    return _keep_except({1}, _ndim(ctx))


def _batch_if(batched_ndim: int):
    """im2col / col2im: the batch dim survives when the input has one."""
    def build(ctx):
        return [(0, 0)] if _ndim(ctx) == batched_ndim else []
    return build


def _diagonal(ctx):
    ndim = _ndim(ctx)
    pair = {_norm(arg(ctx, "dim1"), ndim), _norm(arg(ctx, "dim2"), ndim)}
    rest = [d for d in range(ndim) if d not in pair]  # output: these in order, then the diagonal
    return [(d, i) for i, d in enumerate(rest)]


def _diag_embed(ctx):
    out_ndim = _ndim(ctx) + 1
    pair = {_norm(arg(ctx, "dim1"), out_ndim), _norm(arg(ctx, "dim2"), out_ndim)}
    rest = [d for d in range(out_ndim) if d not in pair]  # input's batch dims land here, in order
    return [(i, d) for i, d in enumerate(rest)]


def _diagonal_scatter(ctx):
    ndim = _ndim(ctx)
    pair = {_norm(arg(ctx, "dim1"), ndim), _norm(arg(ctx, "dim2"), ndim)}
    rest = [d for d in range(ndim) if d not in pair]
    return [(d, i, d) for i, d in enumerate(rest)]


def _select_scatter(ctx):  # src lacks the selected dim
    ndim = _ndim(ctx)
    dim = _norm(arg(ctx, "dim"), ndim)
    return [(d, d if d < dim else d - 1, d) for d in range(ndim) if d != dim]


def _slice_scatter(ctx):
    ndim = _ndim(ctx)
    return _keep_except({_norm(arg(ctx, "dim"), ndim)}, ndim, 2)


def _view_as_complex(ctx):  # the last dim (real, imag) becomes the complex dtype
    return [(d, d) for d in range(_ndim(ctx) - 1)]


def _every_dim(ctx):
    return _keep_except((), _ndim(ctx))


def _none(ctx):
    return []


def _pad_value_zero(ctx) -> bool:
    v = arg(ctx, "value", 0)
    return type(v) is int and v == 0  # floats arrive as a marker: their value is unknown here


# op packet -> (builder, Partials that pass; a callable decides from the call)
TABLE = {
    aten.constant_pad_nd: (_padded("pad"), lambda ctx: ALL if _pad_value_zero(ctx) else ()),
    aten.rot90: (_rot90, ALL),
    aten.repeat: (_repeat, ALL),
    aten.unfold: (_unfold, ALL),
    aten.unfold_copy: (_unfold, ALL),
    aten.pixel_shuffle: (_leading(3), ALL),
    aten.pixel_unshuffle: (_leading(3), ALL),
    aten.channel_shuffle: (_channel_shuffle, ALL),
    aten.native_channel_shuffle: (_channel_shuffle, ALL),
    aten.im2col: (_batch_if(4), ALL),  # zero padding: the same zeros on every rank
    aten.col2im: (_batch_if(3), LINEAR),  # sums overlapping windows
    aten.diagonal: (_diagonal, ALL),
    aten.diagonal_copy: (_diagonal, ALL),
    aten.diag_embed: (_diag_embed, ALL),
    aten.diagonal_scatter: (_diagonal_scatter, ALL),
    aten.select_scatter: (_select_scatter, ALL),
    aten.slice_scatter: (_slice_scatter, ALL),
    aten.view_as_complex: (_view_as_complex, LINEAR),
    aten.view_as_real: (_every_dim, LINEAR),
    aten.tril: (_every_dim, ALL),
    aten.tril_: (_every_dim, ALL),
    aten.triu: (_every_dim, ALL),
    aten.triu_: (_every_dim, ALL),
    aten.trace: (_none, LINEAR),  # the sum of a diagonal is linear
    # backward ops whose arguments hold global sizes: replicated only
    aten.diagonal_backward: (_none, ()),
    aten.unfold_backward: (_none, ()),
    aten.trace_backward: (_none, ()),
}
for _n in (1, 2, 3):
    for _kind in ("reflection", "replication"):
        TABLE[getattr(aten, f"{_kind}_pad{_n}d")] = (_padded("padding"), ALL)
        TABLE[getattr(aten, f"{_kind}_pad{_n}d_backward")] = (_padded("padding", 2), ())


def shape_options(ctx, surviving, partials) -> list:
    """Per-mesh-dim options from the surviving dims; all-Replicate; Partials for float results."""
    specs, outs = ctx.specs, ctx.out_metas
    options = []
    for dims in surviving:
        *ins, out_d = dims
        if all(s.shape[i] == outs[0].shape[out_d] for s, i in zip(specs, ins)):
            options.append((tuple(Shard(i) for i in ins), (Shard(out_d),) * len(outs)))
    options.append(((R,) * len(specs), (R,) * len(outs)))
    dtypes = [m.dtype for m in outs]
    for p in partials(ctx) if callable(partials) else partials:
        if all(t.is_floating_point or (t.is_complex and p in LINEAR) for t in dtypes):
            options.append(((Partial(p),) * len(specs), (Partial(p),) * len(outs)))
    return options


@rule(*TABLE)
def shape_op(ctx):
    builder, partials = TABLE[ctx.op.overloadpacket]
    return shape_options(ctx, builder(ctx), partials)


def _shifted_tri(op, out, largs, lkwargs):
    """tril/triu on a shard: the diagonal moves by the shard's row offset minus its column offset.

    Global element (r, c) is kept when ``c - r <= k`` (tril); on a shard starting at row
    ``r0`` and column ``c0`` that is local ``c' - r' <= k + r0 - c0``.
    """
    spec = out.in_specs[0]
    if spec.ndim < 2 or not any(type(p) is Shard and p.dim % spec.ndim >= spec.ndim - 2 for p in spec.placements):
        return op(*largs, **lkwargs)
    _, offset = spec.local_box()
    args = list(largs)
    k = args[1] if len(args) > 1 else lkwargs.pop("diagonal", 0)
    shifted = k + offset[-2] - offset[-1]
    if len(args) > 1:
        args[1] = shifted
    else:
        args.append(shifted)
    return op(*args, **lkwargs)





def _local_out_shape(spec) -> tuple:
    return spec.local_box()[0]


def _empty_safe(local_op):
    """Wrap a local call: where this rank's piece of the output is empty, make it directly.

    Some kernels reject empty inputs (reflection pads) or return them unchanged
    (pixel_unshuffle), so a rank holding an empty chunk would raise or give a wrongly
    shaped piece; an empty result has no values to get wrong.
    """
    def call(op, out, largs, lkwargs):
        spec = out.out_specs[0]
        if spec is not None and len(out.out_specs) == 1 and not op._schema.is_mutable:
            shape = _local_out_shape(spec)
            if 0 in shape:
                return largs[0].new_empty(shape, dtype=spec.tensor_meta.dtype)
        return local_op(op, out, largs, lkwargs)
    return call


def _plain(op, out, largs, lkwargs):
    return op(*largs, **lkwargs)


for _packet in TABLE:
    if _packet not in (aten.tril, aten.tril_, aten.triu, aten.triu_):
        register_local_call(_packet, _empty_safe(_plain))
for _tri in (aten.tril, aten.tril_, aten.triu, aten.triu_):
    register_local_call(_tri, _empty_safe(_shifted_tri))
