"""View ops as resharding through dim maps (``ops/dim_maps.py``).

Each op has a builder that turns the call into one dim map per output; one full
rule (``per_dim=False``: a mesh dim's answer depends on earlier mesh dims sharding
the same tensor dim) keeps every shard the map carries exactly and replicates the
rest. Options: that one first (the input unchanged when everything survives),
then all-Replicate. Partial passes through unchanged: every view is linear
(except ``view.dtype`` to another dtype, which reinterprets bits).

What reaches ``__torch_dispatch__`` (torch 2.13). With autograd on or under
``no_grad``, composite ops decompose first: ``reshape`` -> ``view`` (or ``clone`` +
``_unsafe_view`` when the strides forbid a view), ``flatten``/``unflatten``/
``view_as``/``reshape_as``/``ravel`` -> ``view``; ``movedim``/``.T`` -> ``permute``;
``swapaxes``/``.mT``/``.mH``/``adjoint`` -> ``transpose.int``; ``expand_as``/
``broadcast_to`` -> ``expand``; ``chunk`` -> ``split.Tensor``; ``narrow``/
``tensor_split``/``hsplit``/``x[a:b]`` -> ``slice.Tensor``; ``x[i]`` -> ``select.int``;
``x[None]`` -> ``unsqueeze``. Under ``torch.inference_mode()`` the composite ops
arrive themselves, so they have rules here too. Backward: view's is ``view``,
permute's ``permute``, unsqueeze's ``squeeze.dim``, squeeze's ``unsqueeze``, select's
``select_backward``, slice/narrow's ``slice_backward`` (rules here), expand's
``sum.dim_IntList``, split's ``cat``, unbind's ``stack`` (other modules).

Ops whose arguments hold sizes (``view(x, [48])``, ``expand``, ``select_backward``'s
``input_sizes``, ...) get a special handler that runs the local op with this
rank's local output shape instead of the global one; squeeze's handler names the
dims that are size 1 globally (a shard can be size 1 on one rank only).

In-place views (``t_``, ``transpose_``, ``unsqueeze_``, ``squeeze_``) run the
functional rule, apply the op to the local tensor in place and give the DTensor
its new spec and shape; they raise when the target would have to be
redistributed (a sharded size-1 dim squeezed away).

Not covered: ``as_strided``, ``unfold``, ``diagonal``, ``view.dtype`` between
dtypes of different sizes with the last dim sharded (replicated instead).
"""
from __future__ import annotations

import functools

import torch

from shardprop.dispatch import dispatcher as _dispatch
from shardprop.dispatch.propagate import ShardingError
from shardprop.dispatch.registry import register_local_call, register_may_copy, rule
from shardprop.tensor.placement import Replicate

from .dim_maps import (
    Resized,
    Same,
    cut_map,
    embed_map,
    expand_map,
    identity_map,
    map_placements,
    movedim_perm,
    permute_map,
    squeeze_map,
    transpose_map,
    unsqueeze_map,
    view_map,
)

aten = torch.ops.aten


# ------------------------------------------------------------------ argument access
def _arg(ctx, i: int, name: str, default=None):
    """Argument ``i`` (or keyword ``name``) of the call, else ``default``."""
    if i < len(ctx.args):
        return ctx.args[i]
    return ctx.kwargs.get(name, default)


def _ints(v) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def _in_shape(ctx):
    return ctx.specs[0].shape


def _out_shapes(ctx):
    return [m.shape for m in ctx.out_metas]


# ------------------------------------------------------------------ builders: ctx -> one map per output
def _reshape(ctx):
    return [view_map(_in_shape(ctx), ctx.out_metas[0].shape)]


def _alias(ctx):
    return [identity_map(ctx.specs[0].ndim)]


def _permute(ctx):
    return [permute_map(ctx.specs[0].ndim, _arg(ctx, 1, "dims"))]


def _transpose(ctx):
    return [transpose_map(ctx.specs[0].ndim, _arg(ctx, 1, "dim0"), _arg(ctx, 2, "dim1"))]


def _t(ctx):  # t, matrix_H: dims 0 and 1 (a 0-d or 1-d tensor is unchanged)
    return [transpose_map(ctx.specs[0].ndim, 0, 1)]


def _mT(ctx):  # mT, mH, adjoint: the last two dims
    return [transpose_map(ctx.specs[0].ndim, -2, -1)]


def _numpy_T(ctx):
    n = ctx.specs[0].ndim
    return [permute_map(n, tuple(reversed(range(n))))]


def _movedim(ctx):
    n = ctx.specs[0].ndim
    perm = movedim_perm(n, _ints(_arg(ctx, 1, "source")), _ints(_arg(ctx, 2, "destination")))
    return [permute_map(n, perm)]


def _squeeze(ctx):
    dims = _arg(ctx, 1, "dim", _arg(ctx, 1, "dims"))
    return [squeeze_map(_in_shape(ctx), None if dims is None else _ints(dims))]


def _unsqueeze(ctx):
    return [unsqueeze_map(ctx.specs[0].ndim, _arg(ctx, 1, "dim"))]


def _expand(ctx):
    return [expand_map(_in_shape(ctx), ctx.out_metas[0].shape)]


def _cut(dim_index: int, keepdim: bool = True, dim_default=0):
    """Builder for ops that take pieces along the dim at argument ``dim_index``."""
    def build(ctx):
        dim = _arg(ctx, dim_index, "dim", dim_default)
        return [cut_map(_in_shape(ctx), s, dim, keepdim) for s in _out_shapes(ctx)]
    return build


def _cut_fixed(dim_of_ndim):
    """Builder for hsplit/vsplit/dsplit: the dim follows from the input's rank."""
    def build(ctx):
        dim = dim_of_ndim(ctx.specs[0].ndim)
        return [cut_map(_in_shape(ctx), s, dim) for s in _out_shapes(ctx)]
    return build


def _embed(keepdim: bool):
    """select_backward (keepdim False) / slice_backward (True): grad put back along ``dim``."""
    def build(ctx):
        return [embed_map(_in_shape(ctx), ctx.out_metas[0].shape, _arg(ctx, 2, "dim"), keepdim)]
    return build


def _view_dtype(ctx):
    spec = ctx.specs[0]
    n = spec.ndim
    if n == 0 or ctx.out_metas[0].dtype.itemsize == spec.dtype.itemsize:
        return [identity_map(n)]
    # Another element size rescales the last dim: keep it only when it is not sharded.
    return [tuple(Same(d) for d in range(n - 1)) + (Resized(n - 1),)]


# op -> builder. Overloads, not packets: ``.out`` variants of the *_copy ops are left out.
BUILDERS = {
    # reshapes: the map comes from the input and output shapes
    aten.view.default: _reshape,
    aten._unsafe_view.default: _reshape,
    aten.view_copy.default: _reshape,
    aten.reshape.default: _reshape,
    aten.view_as.default: _reshape,
    aten.reshape_as.default: _reshape,
    aten.flatten.using_ints: _reshape,
    aten.unflatten.int: _reshape,
    aten.ravel.default: _reshape,
    aten.atleast_1d.default: _reshape,
    aten.atleast_2d.default: _reshape,
    aten.atleast_3d.default: _reshape,
    aten.alias.default: _alias,
    aten.alias_copy.default: _alias,
    aten.view.dtype: _view_dtype,
    # permutations
    aten.permute.default: _permute,
    aten.permute_copy.default: _permute,
    aten.transpose.int: _transpose,
    aten.transpose_copy.int: _transpose,
    aten.swapaxes.default: _transpose,
    aten.swapdims.default: _transpose,
    aten.t.default: _t,
    aten.t_copy.default: _t,
    aten.matrix_H.default: _t,
    aten.mT.default: _mT,
    aten.mH.default: _mT,
    aten.adjoint.default: _mT,
    aten.numpy_T.default: _numpy_T,
    aten.movedim.int: _movedim,
    aten.movedim.intlist: _movedim,
    # size-1 dims and broadcasts
    aten.squeeze.default: _squeeze,
    aten.squeeze.dim: _squeeze,
    aten.squeeze.dims: _squeeze,
    aten.squeeze_copy.default: _squeeze,
    aten.squeeze_copy.dim: _squeeze,
    aten.squeeze_copy.dims: _squeeze,
    aten.unsqueeze.default: _unsqueeze,
    aten.unsqueeze_copy.default: _unsqueeze,
    aten.expand.default: _expand,
    aten.expand_copy.default: _expand,
    aten.expand_as.default: _expand,
    aten.broadcast_to.default: _expand,
    # pieces along one dim
    aten.select.int: _cut(1, keepdim=False),
    aten.select_copy.int: _cut(1, keepdim=False),
    aten.slice.Tensor: _cut(1),
    aten.slice_copy.Tensor: _cut(1),
    aten.narrow.default: _cut(1),
    # narrow.Tensor (a tensor start) has no rule: its composite kernel reads the start with
    # .item() and calls narrow.default, in every autograd mode (shapes need the start's value).
    aten.narrow_copy.default: _cut(1),
    aten.split.Tensor: _cut(2),
    aten.split.sizes: _cut(2),
    aten.split_with_sizes.default: _cut(2),
    aten.split_copy.Tensor: _cut(2),
    aten.split_with_sizes_copy.default: _cut(2),
    aten.unsafe_split.Tensor: _cut(2),
    aten.unsafe_split_with_sizes.default: _cut(2),
    aten.chunk.default: _cut(2),
    aten.unsafe_chunk.default: _cut(2),
    aten.tensor_split.sections: _cut(2),
    aten.tensor_split.indices: _cut(2),
    aten.hsplit.int: _cut_fixed(lambda n: 1 if n > 1 else 0),
    aten.hsplit.array: _cut_fixed(lambda n: 1 if n > 1 else 0),
    aten.vsplit.int: _cut_fixed(lambda n: 0),
    aten.vsplit.array: _cut_fixed(lambda n: 0),
    aten.dsplit.int: _cut_fixed(lambda n: 2),
    aten.dsplit.array: _cut_fixed(lambda n: 2),
    aten.unbind.int: _cut(1, keepdim=False),
    aten.unbind_copy.int: _cut(1, keepdim=False),
    # backward of cuts: the inverse maps
    aten.select_backward.default: _embed(keepdim=False),
    aten.slice_backward.default: _embed(keepdim=True),
}


@rule(*BUILDERS, per_dim=False)
def view_rule(ctx):
    """Keep every shard the op's dim maps carry exactly, replicate the rest; or replicate all.

    Inputs after the first (``view_as``'s ``other``) only lend their shape: left as they are.
    """
    spec = ctx.specs[0]
    maps = BUILDERS[ctx.op](ctx)
    ins, outs = map_placements(maps, spec.shape, spec.mesh.shape, spec.placements)
    if ctx.op is aten.view.dtype and ctx.out_metas[0].dtype != spec.dtype:
        # Reinterpreting bits is not linear: the bits of a sum are not the sum of the bits.
        ins = tuple(Replicate() if p.is_partial() else p for p in ins)
        outs = tuple(tuple(Replicate() if p.is_partial() else p for p in o) for o in outs)
    rest = tuple(s.placements for s in ctx.specs[1:])
    options = [((ins,) + rest, outs)]
    rep = (Replicate(),) * spec.mesh.ndim
    if ins != rep:
        options.append(((rep,) + rest, (rep,) * len(outs)))
    return options


# ------------------------------------------------------------------ local calls
# Some ops cannot run on the shard with the call's own arguments:
# * sizes are global (``view(x, [48])``, ``expand``, ``select_backward``'s ``input_sizes``):
#   the local call gets this rank's output shape instead;
# * ``squeeze()`` / ``squeeze(d)`` drop whatever is size 1 *locally*, and a sharded dim can
#   be size 1 on one rank only: the local call names the dims that are size 1 globally.
@functools.lru_cache(maxsize=4096)
def _local_shape(spec) -> tuple:
    """This rank's shard shape of ``spec`` (specs hash once; the mesh coordinate is fixed)."""
    return spec.local_box()[0]


def _sized(local_op, keep_rest: bool, view_like: bool = False):
    """Local call ``local_op(self, local_out_shape, *rest)``; ``rest`` dropped unless ``keep_rest``.

    ``view_like`` ops fall back to a copying reshape when the shard's strides forbid a view:
    a redistributed input is a fresh tensor (nothing aliases it) that may be a narrow of a
    padded gather, and a shard's strides can differ from the global ones.
    """
    def call(op, out, largs, lkwargs):
        shape = _local_shape(out.out_specs[0])
        rest, kw = (largs[2:], lkwargs) if keep_rest else ((), {})
        if not view_like:
            return local_op(largs[0], shape, *rest, **kw)
        if out.plans[0] is not None:
            return aten.reshape.default(largs[0], shape)
        try:
            return local_op(largs[0], shape)
        except RuntimeError:
            return aten.reshape.default(largs[0], shape)
    return call


@functools.lru_cache(maxsize=4096)
def _squeezed_dims_of(spec, named) -> tuple:
    shape = spec.shape
    n = len(shape)
    dims = range(n) if named is None else _ints(named)
    return tuple(sorted({d % n for d in dims if shape[d % n] == 1})) if n else ()


def _squeezed_dims(spec, args) -> tuple:
    """The dims squeeze drops: those named (all when none) that are size 1 globally."""
    named = args[1] if len(args) > 1 else None
    return _squeezed_dims_of(spec, tuple(named) if isinstance(named, list) else named)


def _squeeze_call(local_op):
    """Local call ``local_op(self, dims)`` (a ``.dims`` overload) with the globally size-1 dims."""
    def call(op, out, largs, lkwargs):
        return local_op(largs[0], _squeezed_dims(out.in_specs[0], largs))
    return call


# op -> local call(op, OutputSharding, local args, local kwargs)
LOCAL_CALLS = {
    aten.view.default: _sized(aten.view.default, False, view_like=True),
    aten._unsafe_view.default: _sized(aten._unsafe_view.default, False, view_like=True),
    aten.view_copy.default: _sized(aten.view_copy.default, False, view_like=True),
    aten.reshape.default: _sized(aten.reshape.default, False),
    aten.unflatten.int: _sized(aten.view.default, False, view_like=True),
    aten.view_as.default: _sized(aten.view.default, False, view_like=True),
    aten.reshape_as.default: _sized(aten.reshape.default, False),
    aten.expand.default: _sized(aten.expand.default, True),
    aten.expand_copy.default: _sized(aten.expand_copy.default, True),
    aten.expand_as.default: _sized(aten.expand.default, False),
    aten.broadcast_to.default: _sized(aten.expand.default, False),
    aten.select_backward.default: _sized(aten.select_backward.default, True),
    aten.slice_backward.default: _sized(aten.slice_backward.default, True),
    aten.squeeze.default: _squeeze_call(aten.squeeze.dims),
    aten.squeeze.dim: _squeeze_call(aten.squeeze.dims),
    aten.squeeze.dims: _squeeze_call(aten.squeeze.dims),
    aten.squeeze_copy.default: _squeeze_call(aten.squeeze_copy.dims),
    aten.squeeze_copy.dim: _squeeze_call(aten.squeeze_copy.dims),
    aten.squeeze_copy.dims: _squeeze_call(aten.squeeze_copy.dims),
}


for _op, _call in LOCAL_CALLS.items():
    register_local_call(_op, _call)
# torch documents reshape's result as "a view or a copy": a write into it need not reach the base,
# so it is not guarded when its input had to move (the dispatcher's _copied_view).
register_may_copy([aten.reshape.default, aten.reshape_as.default])


# ------------------------------------------------------------------ in-place views
# in-place op -> its functional twin, whose rule decides the new spec
INPLACE = {
    aten.t_.default: aten.t.default,
    aten.transpose_.default: aten.transpose.int,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
}


_SQUEEZES = (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)


def _set_wrapper_meta(x, spec) -> None:
    """Give the wrapper tensor ``x`` the global shape and stride of ``spec``.

    Autograd does not change a wrapper subclass's sizes for an in-place view op, and
    any op on ``x`` would come back here: so this one runs below the Python key.
    """
    m = spec.tensor_meta
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
        torch._C.DispatchKey.PythonTLSSnapshot)
    with torch.no_grad(), torch._C._ExcludeDispatchKeyGuard(keys):
        torch.Tensor.as_strided_(x, m.shape, m.stride)


def _inplace_handler(op, args, kwargs):
    x = args[0]

    def compute(fop, out, largs, lkwargs):
        if out.plans[0] is not None:
            raise ShardingError(f"{op}: in-place view would have to redistribute its target "
                                f"{list(x._spec.placements)} to {list(out.in_specs[0].placements)}; "
                                "redistribute it first or use the out-of-place op")
        if fop in _SQUEEZES:
            return aten.squeeze_.dims(largs[0], _squeezed_dims(out.in_specs[0], largs))
        return op(*largs, **lkwargs)  # in place on x's local tensor: its aliases see it too

    res = _dispatch.run(INPLACE[op], args, kwargs, compute=compute)
    x._spec = res._spec
    _set_wrapper_meta(x, res._spec)
    return x


for _op in INPLACE:  # outside a mesh the rule path inside gives the new spec and computes nothing
    _dispatch.register_special(_op, _inplace_handler, outside_safe=True)


# ------------------------------------------------------------------ tensor_split by a tensor
def _tensor_split_by_tensor(op, args, kwargs):
    """``tensor_split(x, t, dim)`` with split points (or a section count) in a tensor ``t``: read ``t``'s
    values (gathered, when a DTensor) and split by them. This composite reaches the dispatcher whole
    only under ``torch.inference_mode()``; with autograd on, torch's C++ kernel reads ``t``'s memory
    directly and a DTensor ``t`` fails there before any DTensor code runs (pass a list or a plain tensor).

    Example:
        >>> torch.tensor_split(x, torch.tensor([1, 3]))  # x a DTensor, under inference_mode  # doctest: +SKIP
    """
    x, t = args[0], args[1]
    dim = args[2] if len(args) > 2 else (kwargs or {}).get("dim", 0)
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    if t.ndim == 0:
        return aten.tensor_split.sections(x, int(t.item()), dim)
    return aten.tensor_split.indices(x, [int(v) for v in t.tolist()], dim)


_dispatch.register_special(aten.tensor_split.tensor_indices_or_sections, _tensor_split_by_tensor)
