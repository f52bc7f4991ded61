"""Neural-network ops: softmax, layer norm, embedding (forward and backward).

Each normalizes or gathers along some dims and is independent along the others:
a shard survives on the independent dims only. Backward ops are linear in the
incoming gradient, so a sum/avg-Partial gradient passes through when the saved
forward tensors are replicated. Sums over sharded batch dims (layer-norm weight
and bias gradients, embedding weight gradient) come out as ``Partial("sum")``.

A vocabulary-sharded embedding table (weight ``S(0)``) needs a masked lookup:
each rank looks up only the rows it holds and writes zeros elsewhere, giving a
``Partial("sum")`` output. No plain rule can change the local computation, so
``aten.embedding`` has a special handler that runs the normal path with that
local computation.
"""
from __future__ import annotations

import torch

from shardprop.layout import local_shape_and_offset
from shardprop.op_schema import _marker
from shardprop.placement import Partial, Replicate, Shard
from shardprop.registry import register_local_call, rule
from shardprop.spec import DTensorSpec

aten = torch.ops.aten
R = Replicate()
_FALSE = _marker("<False>")
# Reductions through which a function linear in the Partial input passes unchanged.
LINEAR_PARTIALS = (Partial("sum"), Partial("avg"))
# Row selection (embedding lookup) commutes with every elementwise reduction.
ALL_PARTIALS = (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"))


def _inputs(ctx, **by_name) -> tuple:
    """One placement per DTensor input (``ctx.specs`` order), chosen by schema argument name.

    Arguments not named are Replicate.

    Example:
        >>> _inputs(ctx, input=Shard(0))  # layer norm: (S(0), R, R) with weight and bias  # doctest: +SKIP
    """
    names = [a.name for a in ctx.op._schema.arguments]
    out = []

    def visit(name, value):
        if type(value) is DTensorSpec:
            out.append(by_name.get(name, R))
        elif type(value) is tuple:
            for v in value:
                visit(name, v)

    for name, value in zip(names, ctx.args):
        visit(name, value)
    for name, value in ctx.kwargs.items():
        visit(name, value)
    return tuple(out)


def _arg(ctx, index: int, name: str, default=None):
    """An argument given by position or keyword."""
    if index < len(ctx.args):
        return ctx.args[index]
    return ctx.kwargs.get(name, default)


def _spec(ctx, index: int, name: str) -> DTensorSpec:
    s = _arg(ctx, index, name)
    if type(s) is not DTensorSpec:
        raise TypeError(f"{ctx.op}: argument {name!r} must be a DTensor")
    return s


# ------------------------------------------------------------------ softmax
@rule(aten._softmax, aten._log_softmax)
def softmax(ctx):
    """Shard any dim but the softmax dim; a Partial input must be reduced first (softmax is not linear)."""
    x = _spec(ctx, 0, "self")
    dim = _arg(ctx, 1, "dim") % max(x.ndim, 1)
    options = [((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != dim]
    options.append(((R,), (R,)))
    return options


@rule(aten._softmax_backward_data, aten._log_softmax_backward_data)
def softmax_backward(ctx):
    """grad and output sharded alike off the softmax dim; linear in grad (with the output replicated)."""
    y = _spec(ctx, 1, "output")
    dim = _arg(ctx, 2, "dim") % max(y.ndim, 1)
    options = [(_inputs(ctx, grad_output=Shard(d), output=Shard(d)), (Shard(d),))
               for d in range(y.ndim) if d != dim]
    options.append((_inputs(ctx), (R,)))
    options += [(_inputs(ctx, grad_output=p), (p,)) for p in LINEAR_PARTIALS]
    return options


# ------------------------------------------------------------------ layer norm
def _leading_dims(ctx, input_index: int, shape_index: int) -> range:
    """The dims layer norm does not normalize over (everything before normalized_shape)."""
    x = _spec(ctx, input_index, "input")
    return range(x.ndim - len(_arg(ctx, shape_index, "normalized_shape")))


@rule(aten.native_layer_norm)
def layer_norm(ctx):
    """Shard a leading dim: out, mean and rstd (shaped like the input, 1 on normalized dims) follow it.

    out = xhat * weight + bias is linear in (weight, bias) together: both sum/avg-Partial give
    a Partial out (mean and rstd only see the input). With the weight replicated, a bias
    Partial under avg/max/min passes too (each commutes with adding the same xhat * weight).
    """
    options = [(_inputs(ctx, input=Shard(d)), (Shard(d),) * 3) for d in _leading_dims(ctx, 0, 1)]
    options.append((_inputs(ctx), (R,) * 3))
    if type(_arg(ctx, 2, "weight")) is DTensorSpec:
        options += [(_inputs(ctx, weight=p, bias=p), (p, R, R)) for p in LINEAR_PARTIALS]
    if type(_arg(ctx, 3, "bias")) is DTensorSpec:
        options += [(_inputs(ctx, bias=p), (p, R, R)) for p in ALL_PARTIALS if p.reduce_op != "sum"]
    return options


@rule(aten.native_layer_norm_backward)
def layer_norm_backward(ctx):
    """grad_input follows a leading-dim shard; grad_weight/grad_bias sum over leading dims: P(sum).

    All three are linear in grad_out, so a linear Partial grad_out passes through.
    """
    batch = ("grad_out", "input", "mean", "rstd")
    options = [(_inputs(ctx, **{n: Shard(d) for n in batch}), (Shard(d), Partial("sum"), Partial("sum")))
               for d in _leading_dims(ctx, 1, 2)]
    options.append((_inputs(ctx), (R,) * 3))
    options += [(_inputs(ctx, grad_out=p), (p,) * 3) for p in LINEAR_PARTIALS]
    return options


# ------------------------------------------------------------------ embedding
@rule(aten.embedding)
def embedding(ctx):
    """Lookup of weight (V, D) rows by indices of any shape; output is indices.shape + (D,).

    The last option, weight ``S(0)`` (vocab-sharded) -> ``P(sum)``, is right only with the
    masked local lookup of ``_embedding_handler``; it is listed last so it wins only
    when it is strictly cheapest (the weight already vocab-sharded).
    """
    idx = _spec(ctx, 1, "indices")
    n = idx.ndim
    options = [(_inputs(ctx, indices=Shard(d)), (Shard(d),)) for d in range(n)]
    options.append((_inputs(ctx, weight=Shard(1)), (Shard(n),)))
    options.append((_inputs(ctx), (R,)))
    options += [(_inputs(ctx, weight=p), (p,)) for p in ALL_PARTIALS]
    options.append((_inputs(ctx, weight=Shard(0)), (Partial("sum"),)))
    return options


@rule(aten.embedding_dense_backward)
def embedding_backward(ctx):
    """Scatter-add of grad rows into a (num_weights, D) gradient.

    Batch-sharded grad and indices each add their own rows: P(sum). Not with
    scale_grad_by_freq, which divides by counts over all indices. A shard of D
    follows to the output's dim 1; a linear Partial grad passes through.
    """
    idx = _spec(ctx, 1, "indices")
    n = idx.ndim
    options = []
    if _arg(ctx, 4, "scale_grad_by_freq", _FALSE) is _FALSE:
        options += [(_inputs(ctx, grad_output=Shard(d), indices=Shard(d)), (Partial("sum"),)) for d in range(n)]
    options.append((_inputs(ctx, grad_output=Shard(n)), (Shard(1),)))
    options.append((_inputs(ctx), (R,)))
    options += [(_inputs(ctx, grad_output=p), (p,)) for p in LINEAR_PARTIALS]
    return options


@rule(aten.embedding_renorm_)
def embedding_renorm(ctx):
    """In place: rescale the rows of weight that indices name (F.embedding's max_norm).

    Every rank must renorm the same rows of the rows it holds: indices replicated, and the
    weight whole-row (a shard of D would need the norm of full rows). A vocab-sharded
    weight renorms its own rows only, with ``_renorm_own_rows``.
    """
    return [(_inputs(ctx), (R,)), (_inputs(ctx, self=Shard(0)), (Shard(0),))]


def _vocab_rows(wspec):
    """(offset, rows) of this rank's slice of a vocab-sharded (``S(0)``) table, else None."""
    if not any(type(p) is Shard and p.dim == 0 for p in wspec.placements):
        return None
    mesh = wspec.mesh
    (rows, *_), (offset, *_) = local_shape_and_offset(wspec.shape, mesh.shape, mesh._coord, wspec.placements)
    return offset, rows


def _masked_lookup(op, out, largs, lkwargs):
    """The local embedding: plain, or, where the weight is vocab-sharded, only this rank's rows.

    Indices outside this rank's rows [offset, offset + rows) read row 0 and are then
    zeroed, so summing over the vocab-sharding ranks gives the full lookup.
    """
    vocab = _vocab_rows(out.in_specs[0])
    if vocab is None:
        return op(*largs, **lkwargs)
    offset, rows = vocab
    weight, indices = largs[0], largs[1]
    if rows == 0:  # an empty trailing shard (uneven vocab): nothing to look up
        return weight.new_zeros(tuple(indices.shape) + (weight.shape[1],))
    local = indices - offset
    outside = (local < 0) | (local >= rows)
    # padding_idx only matters to backward, and is a global row number: not passed on.
    res = op(weight, local.masked_fill(outside, 0))
    return res.masked_fill_(outside.unsqueeze(-1), 0)


def _renorm_own_rows(op, out, largs, lkwargs):
    """embedding_renorm_ on a vocab shard: only the named rows this rank holds, renumbered."""
    vocab = _vocab_rows(out.in_specs[0])
    if vocab is None:
        return op(*largs, **lkwargs)
    offset, rows = vocab
    weight, indices, *rest = largs
    local = indices.reshape(-1) - offset
    return op(weight, local[(local >= 0) & (local < rows)], *rest, **lkwargs)


register_local_call(aten.embedding.default, _masked_lookup)
register_local_call(aten.embedding_renorm_.default, _renorm_own_rows)
