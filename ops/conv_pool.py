"""Convolution, pooling, upsampling and grid sampling (forward and backward).

Pooling and upsampling work on each (batch, channel) plane on its own: every dim
before the trailing spatial dims may stay sharded (all tensor arguments and outputs
alike), the spatial dims must be whole. Linear ones (average pools, upsampling, and
the backward of max pools in grad_output) also carry a sum/avg-Partial.

Convolution mixes input channels and spatial positions but not batch rows: a batch
shard of the input with a replicated weight gives a batch-sharded output, and in
backward the weight and bias gradients (sums over the batch) are ``Partial("sum")``.
With groups == 1 the output channels may also be sharded (weight rows and bias
alike), and the input channels (a contraction: ``Partial("sum")``, only without bias).
"""
from __future__ import annotations

import torch

from shardprop.dispatch.registry import register_local_call, rule
from shardprop.mesh.compat import aten_ops
from shardprop.tensor.placement import Partial, Replicate, Shard

from .nn import _arg, _inputs
from .reduction import pieces_ok

aten = torch.ops.aten
R = Replicate()
LINEAR_PARTIALS = (Partial("sum"), Partial("avg"))

# op packet name -> (number of trailing spatial dims, linear in its first tensor argument
# when the others are replicated). Every tensor argument and output has the same leading dims.
PLANE_OPS = {
    "max_pool2d_with_indices": (2, False), "max_pool2d_with_indices_backward": (2, True),
    "max_pool3d_with_indices": (3, False), "max_pool3d_with_indices_backward": (3, True),
    "avg_pool2d": (2, True), "avg_pool2d_backward": (2, True),
    "avg_pool3d": (3, True), "avg_pool3d_backward": (3, True),
    "_adaptive_avg_pool2d": (2, True), "_adaptive_avg_pool2d_backward": (2, True),
    "_adaptive_avg_pool3d": (3, True), "_adaptive_avg_pool3d_backward": (3, True),
    "adaptive_max_pool2d": (2, False), "adaptive_max_pool2d_backward": (2, True),
    "adaptive_max_pool3d": (3, False), "adaptive_max_pool3d_backward": (3, True),
    "max_unpool2d": (2, True), "max_unpool3d": (3, True),
    "upsample_nearest1d": (1, True), "upsample_nearest2d": (2, True), "upsample_nearest3d": (3, True),
    "_upsample_nearest_exact1d": (1, True), "_upsample_nearest_exact2d": (2, True),
    "_upsample_nearest_exact3d": (3, True),
    "upsample_linear1d": (1, True), "upsample_bilinear2d": (2, True), "upsample_bicubic2d": (2, True),
    "upsample_trilinear3d": (3, True), "_upsample_bilinear2d_aa": (2, True), "_upsample_bicubic2d_aa": (2, True),
}
# Upsample backward ops take the input's full size (leading dims included) as ``input_size``.
UPSAMPLE_BACKWARD = [n + "_backward" for n in PLANE_OPS if "upsample" in n]
PLANE_OPS.update({n: (PLANE_OPS[n[:-len("_backward")]][0], True) for n in UPSAMPLE_BACKWARD})


def _plane_kind(op):
    return PLANE_OPS[op.overloadpacket.__name__]


@rule(*aten_ops(PLANE_OPS))
def plane_op(ctx):
    """Shard any leading (batch/channel) dim of every tensor alike; spatial dims replicated."""
    spatial, linear = _plane_kind(ctx.op)
    specs = ctx.specs
    n_out = len(ctx.out_metas)
    ndim = specs[0].ndim
    lead = ndim - spatial
    options = []
    if all(s.ndim == ndim for s in specs) and all(m is None or len(m.shape) == ndim for m in ctx.out_metas):
        for d in range(max(lead, 0)):
            # A plane op on an empty channel chunk may raise; an empty batch chunk is fine.
            if d > 0 and not pieces_ok(specs[0].shape[d], tuple(ctx.mesh.shape), "nonempty"):
                continue
            options.append(((Shard(d),) * len(specs), (Shard(d),) * n_out))
    options.append(((R,) * len(specs), (R,) * n_out))
    if linear:
        options += [((p,) + (R,) * (len(specs) - 1), (p,) * n_out) for p in LINEAR_PARTIALS]
    return options


def _local_input_size(op, out, largs, lkwargs):
    """upsample backward on a shard: the leading entries of ``input_size`` are the local ones."""
    go = largs[0]
    if len(largs) > 2:
        size = largs[2]
        lead = len(size) - _plane_kind(op)[0]
        largs = list(largs)
        largs[2] = list(go.shape[:lead]) + list(size[lead:])
    elif "input_size" in lkwargs:
        size = lkwargs["input_size"]
        lead = len(size) - _plane_kind(op)[0]
        lkwargs = dict(lkwargs, input_size=list(go.shape[:lead]) + list(size[lead:]))
    return op(*largs, **lkwargs)


for _op in aten_ops(UPSAMPLE_BACKWARD):
    register_local_call(_op, _local_input_size)


# ------------------------------------------------------------------ grid sampler
@rule(aten.grid_sampler_2d, aten.grid_sampler_3d)
def grid_sampler(ctx):
    """input (N, C, *in), grid (N, *out, k) -> (N, C, *out): batch shard, or channel shard with grid whole."""
    options = [(_inputs(ctx, input=Shard(0), grid=Shard(0)), (Shard(0),))]
    if _nonempty(ctx, ctx.specs[0].shape[1]):
        options.append((_inputs(ctx, input=Shard(1)), (Shard(1),)))
    options.append((_inputs(ctx), (R,)))
    return options


@rule(aten.grid_sampler_2d_backward, aten.grid_sampler_3d_backward)
def grid_sampler_backward(ctx):
    """(grad_input, grad_grid): the grid gradient sums over channels, so a channel shard gives P(sum)."""
    options = [(_inputs(ctx, grad_output=Shard(0), input=Shard(0), grid=Shard(0)), (Shard(0), Shard(0)))]
    if _nonempty(ctx, _arg(ctx, 1, "input").shape[1]):
        options.append((_inputs(ctx, grad_output=Shard(1), input=Shard(1)), (Shard(1), Partial("sum"))))
    options.append((_inputs(ctx), (R, R)))
    return options


# ------------------------------------------------------------------ convolution
def _conv_layout(ctx, input_index: int, weight_index: int, transposed_index: int, groups_index: int):
    """(batched, transposed, groups, weight's out-channel dim, weight's in-channel dim)."""
    from shardprop.dispatch.dispatcher import _TRUE
    x = _arg(ctx, input_index, "input")
    w = _arg(ctx, weight_index, "weight")
    transposed = _arg(ctx, transposed_index, "transposed") is _TRUE
    groups = _arg(ctx, groups_index, "groups")
    batched = x.ndim == w.ndim
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    return batched, transposed, groups, out_dim, in_dim


def _nonempty(ctx, size: int) -> bool:
    return pieces_ok(size, tuple(ctx.mesh.shape), "nonempty")


@rule(aten.convolution)
def convolution(ctx):
    """Batch shard -> S(0); out-channel shard of weight (and bias) -> S(1); in-channel shard
    of input and weight -> P(sum) without bias. A Partial input passes when linear (avg always,
    sum without bias)."""
    batched, transposed, groups, wo, wi = _conv_layout(ctx, 0, 1, 6, 8)
    has_bias = _arg(ctx, 2, "bias") is not None
    options = []
    if batched:
        x, w = ctx.specs[0], ctx.specs[1]
        options.append((_inputs(ctx, input=Shard(0)), (Shard(0),)))
        if groups == 1 and _nonempty(ctx, w.shape[wo]):
            options.append((_inputs(ctx, weight=Shard(wo), bias=Shard(0)), (Shard(1),)))
        if groups == 1 and not has_bias and _nonempty(ctx, x.shape[1]):
            options.append((_inputs(ctx, input=Shard(1), weight=Shard(wi)), (Partial("sum"),)))
    options.append((_inputs(ctx), (R,)))
    options.append((_inputs(ctx, input=Partial("avg")), (Partial("avg"),)))
    if not has_bias:
        options.append((_inputs(ctx, input=Partial("sum")), (Partial("sum"),)))
    return options


@rule(aten.convolution_backward)
def convolution_backward(ctx):
    """(grad_input, grad_weight, grad_bias) for each forward layout; all linear in grad_output."""
    batched, transposed, groups, wo, wi = _conv_layout(ctx, 1, 2, 7, 9)
    options = []
    ps = Partial("sum")
    if batched:
        x, w = _arg(ctx, 1, "input"), _arg(ctx, 2, "weight")
        options.append((_inputs(ctx, grad_output=Shard(0), input=Shard(0)), (Shard(0), ps, ps)))
        if groups == 1 and _nonempty(ctx, w.shape[wo]):
            options.append((_inputs(ctx, grad_output=Shard(1), weight=Shard(wo)), (ps, Shard(wo), Shard(0))))
        if groups == 1 and _nonempty(ctx, x.shape[1]):
            options.append((_inputs(ctx, input=Shard(1), weight=Shard(wi)), (Shard(1), Shard(wi), R)))
    options.append((_inputs(ctx), (R, R, R)))
    options.append((_inputs(ctx, grad_output=ps), (ps, ps, ps)))
    return options


def _local_bias_sizes(op, out, largs, lkwargs):
    """convolution_backward on a channel shard: ``bias_sizes`` is the local output channel count."""
    go, w = largs[0], largs[2]
    if len(largs) > 3 and largs[3] is not None and go.ndim == w.ndim:
        largs = list(largs)
        largs[3] = [go.shape[1]]
    return op(*largs, **lkwargs)


register_local_call(aten.convolution_backward.default, _local_bias_sizes)
