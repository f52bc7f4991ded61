"""Joining ops: ``cat`` and ``stack`` (split's and unbind's backward), and the
composite spellings that reach ``__torch_dispatch__`` under ``torch.inference_mode``
(``concat``, ``concatenate``, ``hstack``, ``vstack``, ``dstack``, ``column_stack``).

cat along ``d`` moves values without combining them: each output element comes
from exactly one input. So, on each mesh dim:

* a shard of a dim ``e != d`` survives when every input has it: cat makes the inputs
  agree in size on ``e``, hence in torch.chunk boundaries, and each rank's local cat is
  its chunk of the result;
* ``d`` itself cannot stay sharded: the local cats interleave the inputs' pieces
  (rank 0 holds ``[a0 b0]``) where the result's chunks are ``[a0 a1]``, ``[b0 b1]``;
* any Partial (sum, avg, max, min) passes when every input has that same one.

stack along ``d`` is cat of the inputs unsqueezed at ``d``: input dim ``e`` is output
dim ``e`` if ``e < d``, else ``e + 1``; nothing can be sharded along the new dim.

Legacy: cat skips 1-d inputs of shape ``(0,)`` whatever the others' rank. Every
local piece of such a tensor is ``(0,)`` too, so every rank skips it under any
placement: these inputs keep their placements (moving nothing costs a collective).
"""
from __future__ import annotations

import torch

from shardprop.dispatch.registry import rule
from shardprop.tensor.placement import Partial, Replicate, Shard

aten = torch.ops.aten

# Every reduction passes: no output element combines values (see above).
PARTIALS = tuple(Partial(r) for r in ("sum", "avg", "max", "min"))


def _dim_arg(default: int):
    """The ``dim`` argument (second positional or keyword), else ``default``."""
    def dim_of(ctx):
        if len(ctx.args) > 1:
            return ctx.args[1]
        return ctx.kwargs.get("dim", default)
    return dim_of


def _hstack_dim(ctx):  # torch: atleast_1d, then dim 0 if the first is 1-d, else dim 1
    return 0 if ctx.args[0][0].ndim <= 1 else 1


# op packet -> the cat dim the call joins along (before atleast_Nd, the same dim of the result).
# hstack/vstack/dstack/column_stack first lift inputs with atleast_Nd: when that changes an
# input's rank the result's dims no longer line up with it, and only Replicate/Partial are offered.
CAT_DIM = {
    aten.cat: _dim_arg(0),
    aten.concat: _dim_arg(0),
    aten.concatenate: _dim_arg(0),
    aten.hstack: _hstack_dim,
    aten.vstack: lambda ctx: 0,
    aten.dstack: lambda ctx: 2,
    aten.column_stack: lambda ctx: 1,
}
STACK_DIM = {aten.stack: _dim_arg(0)}


def _overloads(packets):
    return [getattr(p, name) for p in packets for name in ("default", "out")]


def _is_skipped(spec) -> bool:
    """A legacy empty input: cat ignores 1-d tensors of shape (0,) (on every rank, under any layout)."""
    return tuple(spec.shape) == (0,)


def _with_skipped(ctx, options, skipped):
    """Expand options over real inputs into options over all inputs.

    A skipped input may be anything; per mesh dim it costs nothing only in its own
    placement there, so variant ``m`` gives each skipped input its placement on mesh
    dim ``m`` (the engine then finds a free variant on every mesh dim).
    """
    if not any(skipped):
        return options
    specs = ctx.specs
    variants = list(dict.fromkeys(
        tuple(s.placements[m] for s, free in zip(specs, skipped) if free) for m in range(ctx.mesh.ndim)))
    out = []
    for ins, outs in options:
        for v in variants:
            it_real, it_free = iter(ins), iter(v)
            out.append((tuple(next(it_free) if free else next(it_real) for free in skipped), outs))
    return out


def _same_everywhere(n_in: int, n_out: int, p, q=None):
    return ((p,) * n_in, (q if q is not None else p,) * n_out)


@rule(*_overloads(CAT_DIM))
def cat_rule(ctx):
    """Keep any shared shard off the cat dim, any shared Partial; else replicate.

    Example: cat([S(1), S(1)], dim=0) -> S(1); cat([S(0), S(0)], dim=0) -> both gathered.
    """
    specs = ctx.specs
    skipped = [_is_skipped(s) for s in specs]
    n_real = len(specs) - sum(skipped)
    out_ndim = len(ctx.out_metas[0].shape)
    n_out = len(ctx.out_metas)
    options = []
    # Shards carry over only when no input changes rank on its way in (atleast_Nd).
    if n_real and out_ndim and all(s.ndim == out_ndim for s, free in zip(specs, skipped) if not free):
        d = CAT_DIM[ctx.op.overloadpacket](ctx) % out_ndim
        options += [_same_everywhere(n_real, n_out, Shard(e)) for e in range(out_ndim) if e != d]
    options.append(_same_everywhere(n_real, n_out, Replicate()))
    options += [_same_everywhere(n_real, n_out, p) for p in PARTIALS]
    return _with_skipped(ctx, options, skipped)


@rule(*_overloads(STACK_DIM))
def stack_rule(ctx):
    """Input dim ``e`` -> output dim ``e`` (``e < d``) or ``e + 1``; Partials pass; else replicate.

    Example: stack([S(1), S(1)], dim=0) -> S(2); stack([S(0), S(0)], dim=-1) -> S(0).
    """
    n_in = len(ctx.specs)
    n_out = len(ctx.out_metas)
    out_ndim = len(ctx.out_metas[0].shape)
    d = STACK_DIM[ctx.op.overloadpacket](ctx) % out_ndim
    options = [_same_everywhere(n_in, n_out, Shard(e), Shard(e if e < d else e + 1)) for e in range(out_ndim - 1)]
    options.append(_same_everywhere(n_in, n_out, Replicate()))
    options += [_same_everywhere(n_in, n_out, p) for p in PARTIALS]
    return options
