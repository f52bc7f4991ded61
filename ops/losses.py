"""Loss functions (forward and backward): elementwise losses, nll_loss, margin losses, ctc.

A loss with ``reduction`` none (0) is independent per element or per sample, so a shard
of an aligned dim survives. Reducing a sharded dim with sum (2) leaves each rank with
the sum of its own elements: ``Partial("sum")``. Mean (1) is ``Partial("avg")`` only
when every rank holds the same number of elements (the dim splits evenly on every
mesh dim), see ``ops.reduction.pieces_ok``.

Backward kernels of mean losses scale by the LOCAL element count (``self.numel()``),
so they run replicated; with none or sum they are pointwise in the saved tensors.

``nll_loss`` with mean divides by the total weight of the whole batch. It is exact on
a batch shard when the target is replicated: each rank sums its own rows and divides
by the global total weight, computed from the full target (``_nll_mean_on_shard``),
and the per-rank results add up: ``Partial("sum")``.
"""
from __future__ import annotations

import torch

from shardprop.dispatch.dispatcher import register_special
from shardprop.dispatch.registry import register_local_call, rule
from shardprop.tensor.placement import Partial, Replicate, Shard
from shardprop.tensor.spec import DTensorSpec

from .nn import _inputs, replicate_options
from .pointwise import _aligned_dim, pointwise_options
from .reduction import pieces_ok
from .replicated import run_whole

aten = torch.ops.aten
R = Replicate()
NONE, MEAN, SUM = 0, 1, 2


def _reduction(ctx) -> int:
    """The call's reduction enum (0 none, 1 mean, 2 sum), given or defaulted."""
    for i, a in enumerate(ctx.op._schema.arguments):
        if a.name == "reduction":
            if i < len(ctx.args):
                return ctx.args[i]
            return ctx.kwargs.get("reduction", a.default_value)
    raise KeyError(f"{ctx.op} has no reduction argument")


def _even(ctx, size: int) -> bool:
    return pieces_ok(size, tuple(ctx.mesh.shape), "even")


# ------------------------------------------------------------------ elementwise losses
# Forward ops: loss of self against target (and weights), broadcast together.
ELEMENTWISE = [aten.mse_loss, aten.smooth_l1_loss, aten.huber_loss, aten.soft_margin_loss,
               aten.binary_cross_entropy, aten.binary_cross_entropy_with_logits]
# Their backward ops (grad_output first; 0-dim unless reduction is none).
ELEMENTWISE_BACKWARD = [aten.mse_loss_backward, aten.smooth_l1_loss_backward, aten.huber_loss_backward,
                        aten.soft_margin_loss_backward, aten.binary_cross_entropy_backward]


@rule(*ELEMENTWISE)
def elementwise_loss(ctx):
    """none: pointwise; sum: a sharded dim gives P(sum); mean: P(avg) when the dim splits evenly."""
    red = _reduction(ctx)
    if red == NONE:
        return pointwise_options(ctx)
    specs = ctx.specs
    shape = torch.broadcast_shapes(*(s.shape for s in specs))
    n_out = len(ctx.out_metas)
    options = []
    for d in range(len(shape)):
        if red == MEAN and not _even(ctx, shape[d]):
            continue
        ins = []
        for s in specs:
            i = _aligned_dim(s.shape, len(shape), d)
            ins.append(R if i is None or s.shape[i] != shape[d] else Shard(i))
        options.append((tuple(ins), (Partial("sum" if red == SUM else "avg"),) * n_out))
    options.append(((R,) * len(specs), (R,) * n_out))
    return options


@rule(*ELEMENTWISE_BACKWARD)
def elementwise_loss_backward(ctx):
    """Pointwise in (grad, self, target) for none/sum; mean divides by the local numel: replicate."""
    if _reduction(ctx) == MEAN:
        return _linear_in_grad(ctx, replicate_options(ctx))
    return _linear_in_grad(ctx, pointwise_options(ctx))


def _linear_in_grad(ctx, options):
    """Add: a sum/avg-Partial grad_output (everything else replicated) gives the same Partial."""
    if type(ctx.args[0]) is DTensorSpec:
        n_out = len(ctx.out_metas)
        for p in (Partial("sum"), Partial("avg")):
            options.append(((p,) + (R,) * (len(ctx.specs) - 1), (p,) * n_out))
    return options


# ------------------------------------------------------------------ nll_loss
def _nll_dim_pairs(self_ndim: int):
    """(self dim, target dim) pairs: every self dim but the class dim 1 (none for unbatched (C,))."""
    if self_ndim < 2:
        return []
    return [(d, d if d == 0 else d - 1) for d in range(self_ndim) if d != 1]


@rule(aten.nll_loss_forward, aten.nll_loss2d_forward)
def nll_loss(ctx):
    """(output, total_weight). none: output sharded like target; sum: both P(sum);
    mean: P(sum) output from a batch shard with the target replicated (see ``_nll_mean_on_shard``)."""
    x = ctx.specs[0]
    red = _reduction(ctx)
    options = []
    for sd, td in _nll_dim_pairs(x.ndim):
        if red == NONE:  # total_weight is 0 on every rank
            options.append((_inputs(ctx, self=Shard(sd), target=Shard(td)), (Shard(td), R)))
        elif red == SUM:
            options.append((_inputs(ctx, self=Shard(sd), target=Shard(td)), (Partial("sum"),) * 2))
        else:
            options.append((_inputs(ctx, self=Shard(sd)), (Partial("sum"), R)))
    options.append((_inputs(ctx), (R, R)))
    return options


@rule(aten.nll_loss_backward, aten.nll_loss2d_backward)
def nll_loss_backward(ctx):
    """grad_input follows a shard of self (target alike); total_weight must be the global one (R)."""
    x = _named_spec(ctx, "self")
    red = _reduction(ctx)
    options = []
    for sd, td in _nll_dim_pairs(x.ndim):
        by = {"self": Shard(sd), "target": Shard(td)}
        if red == NONE:
            by["grad_output"] = Shard(td)
        options.append((_inputs(ctx, **by), (Shard(sd),)))
    options.append((_inputs(ctx), (R,)))
    return options


def _named_spec(ctx, name):
    for i, a in enumerate(ctx.op._schema.arguments):
        if a.name == name:
            return ctx.args[i] if i < len(ctx.args) else ctx.kwargs[name]
    raise KeyError(name)


def _bind(op, largs, lkwargs) -> dict:
    """name -> value of a call's arguments (positional and keyword)."""
    names = [a.name for a in op._schema.arguments]
    bound = dict(zip(names, largs))
    bound.update(lkwargs)
    return bound


def _nll_mean_on_shard(op, out, largs, lkwargs):
    """nll_loss mean on a shard of self with the full target: local sum / global total weight.

    Example: a batch of 8 over 4 ranks; rank r sums -w[t]*x[n, t] over its 2 rows and
    divides by the total weight of all 8 targets; the four results add up to the mean.
    """
    b = _bind(op, largs, lkwargs)
    xs = out.in_specs[0]
    if b["reduction"] != MEAN or not any(type(p) is Shard for p in xs.placements):
        return op(*largs, **lkwargs)
    x, target, weight, ignore = b["self"], b["target"], b["weight"], b["ignore_index"]
    size, offset = xs.local_box()
    mine = target
    for sd, td in _nll_dim_pairs(x.ndim):
        if mine.shape[td] != size[sd]:
            mine = mine.narrow(td, offset[sd], size[sd])
    total, _ = op(x, mine, weight, SUM, ignore)
    keep = target != ignore
    if weight is None:
        tw = keep.sum().to(x.dtype)
    else:
        tw = (weight[target.masked_fill(~keep, 0)] * keep).sum().to(x.dtype)
    return total / tw, tw


register_local_call(aten.nll_loss_forward.default, _nll_mean_on_shard)
register_local_call(aten.nll_loss2d_forward.default, _nll_mean_on_shard)


# ------------------------------------------------------------------ per-sample losses
# op -> the batch-aligned tensor arguments besides grad_output; every one is (N, ...).
PER_SAMPLE = {
    aten.multi_margin_loss.default: ("self", "target"),
    aten.multilabel_margin_loss_forward.default: ("self", "target"),
}


@rule(*PER_SAMPLE)
def per_sample_loss(ctx):
    """Loss per row of (N, C): batch shard gives S(0) (none), P(sum) (sum), P(avg) (mean, even N).

    Extra outputs (multilabel's is_target, shaped like self) follow the batch shard.
    """
    x = ctx.specs[0]
    red = _reduction(ctx)
    n_extra = len(ctx.out_metas) - 1
    options = []
    if x.ndim == 2 and (red != MEAN or _even(ctx, x.shape[0])):
        loss = {NONE: Shard(0), SUM: Partial("sum"), MEAN: Partial("avg")}[red]
        options.append((_inputs(ctx, **{n: Shard(0) for n in PER_SAMPLE[ctx.op]}), (loss,) + (Shard(0),) * n_extra))
    options.append((_inputs(ctx), (R,) * len(ctx.out_metas)))
    return options


# ------------------------------------------------------------------ others
@rule(aten.log_sigmoid_forward)
def log_sigmoid_forward(ctx):
    """(output, buffer): pointwise when the buffer is shaped like the input (CPU); else replicate."""
    shape = ctx.specs[0].shape
    if all(m is not None and m.shape == shape for m in ctx.out_metas):
        return pointwise_options(ctx)
    return replicate_options(ctx)


# ------------------------------------------------------------------ no meta kernel: run replicated
# These have no meta kernel, so the engine cannot infer their output shapes: a special
# handler gathers every DTensor argument and runs the op on whole tensors (ctc aligns whole
# sequences; the margin backward ops divide by the local batch for mean anyway).
NO_META = [aten._ctc_loss.default, aten._ctc_loss.Tensor, aten._ctc_loss_backward.default,
           aten._ctc_loss_backward.Tensor, aten.multi_margin_loss_backward.default,
           aten.multilabel_margin_loss_backward.default]


for _op in NO_META:
    register_special(_op, run_whole)
