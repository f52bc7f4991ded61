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

from shardprop.dispatch.op_schema import _marker
from shardprop.dispatch.registry import register_local_call, rule
from shardprop.tensor.placement import Partial, Replicate, Shard
from shardprop.tensor.spec import DTensorSpec

from .args import inputs_by_name

aten = torch.ops.aten
R = Replicate()
_FALSE = _marker("<False>")
# Reductions through which a function linear in the Partial input passes unchanged.
LINEAR_PARTIALS = (Partial("sum"), Partial("avg"))
# Row selection (embedding lookup) commutes with every elementwise reduction.
ALL_PARTIALS = (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"))


_inputs = inputs_by_name


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


# ------------------------------------------------------------------ rms norm (the fused kernel)
# torch.rms_norm reaches aten._fused_rms_norm on CUDA (and wherever a backend registers a
# kernel); elsewhere the op is composite and decomposes before it reaches a rule.
@rule(aten._fused_rms_norm)
def rms_norm(ctx):
    """Shard a leading dim: out and rstd (input shape, 1 on normalized dims) follow it.

    out = x * rstd(x) * weight is linear in weight, so a sum/avg-Partial weight gives a
    Partial out; rstd only sees the input and stays replicated.
    """
    options = [(_inputs(ctx, input=Shard(d)), (Shard(d),) * 2) for d in _leading_dims(ctx, 0, 1)]
    options.append((_inputs(ctx), (R,) * 2))
    if type(_arg(ctx, 2, "weight")) is DTensorSpec:
        options += [(_inputs(ctx, weight=p), (p, R)) for p in LINEAR_PARTIALS]
    return options


@rule(aten._fused_rms_norm_backward)
def rms_norm_backward(ctx):
    """grad_input follows a leading-dim shard; grad_weight sums over leading dims: P(sum).

    Both are linear in grad_out, so a linear Partial grad_out passes through. grad_input
    is linear in weight too (grad_weight does not see it): a Partial weight gives a
    Partial grad_input and a replicated grad_weight. Outputs output_mask leaves out
    (or grad_weight without a weight) are None and take no placement.
    """
    batch = ("grad_out", "input", "rstd")
    options = [(_inputs(ctx, **{n: Shard(d) for n in batch}), (Shard(d), Partial("sum")))
               for d in _leading_dims(ctx, 1, 2)]
    options.append((_inputs(ctx), (R,) * 2))
    options += [(_inputs(ctx, grad_out=p), (p,) * 2) for p in LINEAR_PARTIALS]
    if type(_arg(ctx, 4, "weight")) is DTensorSpec:
        options += [(_inputs(ctx, weight=p), (p, R)) for p in LINEAR_PARTIALS]
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
    (rows, *_), (offset, *_) = wspec.local_box()
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


def replicate_options(ctx) -> list:
    """The one option of an op that only runs on whole tensors: every input and output replicated."""
    return [((R,) * len(ctx.specs), (R,) * len(ctx.out_metas))]


# ------------------------------------------------------------------ group norm
@rule(aten.native_group_norm)
def group_norm(ctx):
    """(out, mean, rstd): statistics per (sample, group), so a batch shard survives (mean and
    rstd are (N, group)). ``N`` is passed by value: ``_local_batch`` gives the kernel the local one."""
    return [(_inputs(ctx, input=Shard(0)), (Shard(0),) * 3), (_inputs(ctx), (R,) * 3)]


@rule(aten.native_group_norm_backward)
def group_norm_backward(ctx):
    """Batch shard: grad_input S(0); grad_weight and grad_bias sum over the batch: P(sum)."""
    batch = {n: Shard(0) for n in ("grad_out", "input", "mean", "rstd")}
    return [(_inputs(ctx, **batch), (Shard(0), Partial("sum"), Partial("sum"))), (_inputs(ctx), (R,) * 3)]


def _local_batch(n_index: int, input_index: int):
    """A local call that replaces the batch-size argument at ``n_index`` by the local batch."""
    def call(op, out, largs, lkwargs):
        largs = list(largs)
        largs[n_index] = largs[input_index].shape[0]
        return op(*largs, **lkwargs)
    return call


register_local_call(aten.native_group_norm.default, _local_batch(3, 0))
register_local_call(aten.native_group_norm_backward.default, _local_batch(5, 1))


# ------------------------------------------------------------------ batch norm
# op -> index of the training flag (True/False when the op fixes it). In training the
# statistics are over every dim but the channel dim 1: only a channel shard survives.
# In eval the running statistics are fixed: the op is pointwise per channel.
BATCH_NORM = {
    aten.native_batch_norm.default: 5,
    aten._native_batch_norm_legit.default: 5,
    aten._native_batch_norm_legit.no_stats: 3,
    aten._native_batch_norm_legit_no_training.default: False,
    aten._batch_norm_with_update.default: True,
    aten._batch_norm_no_update.default: False,
    aten.native_batch_norm_backward.default: 7,
    aten.batch_norm_backward.default: 7,
}
# Per-channel tensors: (C,) when given (empty (0,) saves in eval stay replicated).
PER_CHANNEL = ("weight", "bias", "running_mean", "running_var", "save_mean", "save_invstd", "save_var", "reserve")


def _named(ctx) -> dict:
    """Schema argument name -> value for the call."""
    names = [a.name for a in ctx.op._schema.arguments]
    out = dict(zip(names, ctx.args))
    out.update(ctx.kwargs)
    return out


def _training(ctx) -> bool:
    from shardprop.dispatch.dispatcher import _TRUE
    flag = BATCH_NORM[ctx.op]
    if type(flag) is not bool:
        flag = ctx.args[flag] is _TRUE
    # Without running statistics even "eval" normalizes by the batch's own statistics.
    return flag or _named(ctx).get("running_mean") is None


@rule(*BATCH_NORM, per_dim=False)
def batch_norm(ctx):
    """Full-mesh options: the product of the per-mesh-dim options, where in training each mesh
    dim keeps the running statistics' placement on that dim (they are updated in place)."""
    import itertools
    options = _batch_norm_per_dim(ctx)
    per_dim = [options] * ctx.mesh.ndim
    if _training(ctx) and "grad_out" not in _named(ctx):
        per_dim = [_keep_running_stats(ctx, options, m) for m in range(ctx.mesh.ndim)]
    full = []
    for combo in itertools.product(*per_dim):
        ins = tuple(tuple(o[0][i] for o in combo) for i in range(len(ctx.specs)))
        outs = tuple(tuple(o[1][j] for o in combo) for j in range(len(combo[0][1])))
        full.append((ins, outs))
    return full


def _batch_norm_per_dim(ctx):
    """Channel shard (input S(1), per-channel tensors S(0)); in eval also any other dim of the input.

    In training the kernel updates running_mean/running_var in place: they must not be
    moved, so only options that keep their current (uniform) placement are offered.
    """
    named = _named(ctx)
    backward = "grad_out" in named
    x = named["input"]
    C = x.shape[1] if x.ndim > 1 else None
    n_out = len(ctx.out_metas)
    training = _training(ctx)

    def chan(m):
        return Shard(0) if m is not None and tuple(m.shape) == (C,) else R

    def saved(m):
        # In eval the CPU kernel saves empty (0,) tensors (meta says (C,)): never shard them.
        return chan(m) if training else R

    options = []
    if not training and C is not None:  # the option that keeps a batch/spatial shard first
        for d in range(x.ndim):
            if d == 1 or not _nonempty(ctx, x.shape[d]):  # an empty batch divides by zero (SIGFPE)
                continue
            by = {"input": Shard(d), "grad_out": Shard(d)}
            if backward:
                options.append((_inputs(ctx, **by), (Shard(d), Partial("sum"), Partial("sum"))))
            else:
                options.append((_inputs(ctx, **by), (Shard(d),) + (R,) * (n_out - 1)))
    if C is not None and _nonempty(ctx, C):  # a rank with no channels would raise alone
        by = {n: (saved if n.startswith(("save", "reserve")) else chan)(named[n])
              for n in PER_CHANNEL if type(named.get(n)) is DTensorSpec}
        by["input"] = Shard(1)
        if backward:
            by["grad_out"] = Shard(1)
            outs = (Shard(1), chan(ctx.out_metas[1]), chan(ctx.out_metas[2]))
        else:
            outs = (Shard(1),) + tuple(saved(m) for m in ctx.out_metas[1:])
        options.append((_inputs(ctx, **by), outs))
    options.append((_inputs(ctx), (R,) * n_out))
    return options


def _nonempty(ctx, size: int) -> bool:
    from .reduction import pieces_ok
    return pieces_ok(size, tuple(ctx.mesh.shape), "nonempty")


def _keep_running_stats(ctx, options, m: int):
    """The options that leave the in-place running statistics as they are on mesh dim ``m``."""
    names = [a.name for a in ctx.op._schema.arguments]
    order = []  # the ctx.specs positions of running_mean / running_var

    def visit(name, value):
        if type(value) is DTensorSpec:
            order.append(name)
    for name, value in zip(names, ctx.args):
        visit(name, value)
    for name, value in ctx.kwargs.items():
        visit(name, value)
    stats = [i for i, n in enumerate(order) if n in ("running_mean", "running_var")]
    if not stats:
        return options
    kept = [o for o in options if all(ctx.specs[i].placements[m] == o[0][i] for i in stats)]
    if not kept:
        from shardprop.dispatch.propagate import ShardingError
        raise ShardingError(f"{ctx.op}: training batch norm updates running_mean/running_var in place; "
                            f"on mesh dim {m} they must be replicated, or sharded on dim 0 (channel shard) "
                            "where the channels split into non-empty pieces")
    return kept


# ------------------------------------------------------------------ prelu, dropout backward
@rule(aten._prelu_kernel)
def prelu(ctx):
    """x > 0 ? x : w * x with w broadcast (1, C, 1, ...): pointwise."""
    from .pointwise import pointwise_options
    return pointwise_options(ctx)


@rule(aten._prelu_kernel_backward)
def prelu_backward(ctx):
    """(grad_input, grad_weight): pointwise, but grad_weight sums over the dims w broadcasts: P(sum)."""
    from .pointwise import _aligned_dim
    go, x, w = ctx.specs
    out_shape = x.shape
    options = []
    for d in range(len(out_shape)):
        ins = []
        for s in ctx.specs:
            i = _aligned_dim(s.shape, len(out_shape), d)
            ins.append(R if i is None or s.shape[i] != out_shape[d] else Shard(i))
        gw = ins[2] if type(ins[2]) is Shard else Partial("sum")
        options.append((tuple(ins), (Shard(d), gw)))
    options.append(((R,) * 3, (R, R)))
    return options


@rule(aten.native_dropout_backward)
def dropout_backward(ctx):
    """grad * mask * scale: pointwise, linear in grad."""
    from .pointwise import pointwise_options
    return pointwise_options(ctx, linear_first=True)


# ------------------------------------------------------------------ attention
def _attn_shape_ok(q, k, v) -> bool:
    return q.ndim == k.ndim == v.ndim == 4 and q.shape[:2] == k.shape[:2] == v.shape[:2]


def _attn_dims(ctx, q, causal: bool):
    """Dims of (B, H, L, E) that may be sharded: batch, heads, and the query sequence unless
    causal (the mask is positional); each only where no rank gets an empty piece."""
    from .reduction import pieces_ok
    dims = (0, 1) if causal else (0, 1, 2)
    return [d for d in dims if pieces_ok(q.shape[d], tuple(ctx.mesh.shape), "nonempty")]


def _mask_placement(mask, dim: int, size: int):
    """The placement of a broadcastable (…, L, S) mask when dim ``dim`` of (B, H, L, S) is sharded."""
    i = dim - (4 - mask.ndim)
    return Shard(i) if i >= 0 and mask.shape[i] == size else R


@rule(aten._scaled_dot_product_flash_attention_for_cpu)
def sdpa(ctx):
    """(out, logsumexp) of q (B, H, L, E), k, v (B, H, S, *): batch or head shard of q, k, v alike;
    without a causal mask also a shard of the query sequence (k and v whole)."""
    from shardprop.dispatch.dispatcher import _TRUE
    named = _named(ctx)
    q, k, v, mask = named["query"], named["key"], named["value"], named.get("attn_mask")
    options = []
    if _attn_shape_ok(q, k, v):
        for d in _attn_dims(ctx, q, named.get("is_causal") is _TRUE):
            names = ("query", "key", "value") if d < 2 else ("query",)
            by = {n: Shard(d) for n in names}
            if type(mask) is DTensorSpec:
                by["attn_mask"] = _mask_placement(mask, d, q.shape[d])
            options.append((_inputs(ctx, **by), (Shard(d), Shard(d))))
    options.append((_inputs(ctx), (R, R)))
    return options


def _sdpa_call(op, out, largs, lkwargs):
    """Refuse attention dropout on shards: each rank's kernel would draw its own mask for its
    piece, which is not the matching piece of one device's mask (every rank raises alike)."""
    p = largs[3] if len(largs) > 3 else lkwargs.get("dropout_p", 0.0)
    if p and any(type(pl) is Shard for spec in out.in_specs for pl in spec.placements):
        from shardprop.dispatch.propagate import ShardingError
        raise ShardingError(
            f"{op}: dropout_p={p} on sharded inputs {[list(s.placements) for s in out.in_specs]} is not "
            "supported (the masks would not match a single device's); use dropout_p=0 with sharded inputs "
            "or replicate q, k and v")
    return op(*largs, **lkwargs)


register_local_call(aten._scaled_dot_product_flash_attention_for_cpu.default, _sdpa_call)


@rule(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def sdpa_backward(ctx):
    """Batch/head shard: every tensor alike. Query-sequence shard: k and v gradients are P(sum)."""
    from shardprop.dispatch.dispatcher import _TRUE
    named = _named(ctx)
    q, k, v, mask = named["query"], named["key"], named["value"], named.get("attn_mask")
    options = []
    if _attn_shape_ok(q, k, v):
        for d in _attn_dims(ctx, q, named.get("is_causal") is _TRUE):
            if d < 2:
                by = {n: Shard(d) for n in ("grad_out", "query", "key", "value", "out", "logsumexp")}
                outs = (Shard(d),) * 3
            else:  # k and v gradients sum over query positions
                by = {n: Shard(2) for n in ("grad_out", "query", "out", "logsumexp")}
                outs = (Shard(2), Partial("sum"), Partial("sum"))
            if type(mask) is DTensorSpec:
                by["attn_mask"] = _mask_placement(mask, d, q.shape[d])
            options.append((_inputs(ctx, **by), outs))
    options.append((_inputs(ctx), (R,) * 3))
    return options


# ------------------------------------------------------------------ replicate-only
REPLICATE_ONLY = [aten._embedding_bag_forward_only, aten._embedding_bag, aten._embedding_bag_backward,
                  aten._embedding_bag_dense_backward, aten._embedding_bag_per_sample_weights_backward,
                  aten._trilinear]


@rule(*REPLICATE_ONLY)
def replicate_only(ctx):
    """Bags with offsets into a flat index list, bilinear's three-way product: whole tensors."""
    return replicate_options(ctx)
