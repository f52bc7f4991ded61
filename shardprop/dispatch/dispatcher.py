"""The op dispatcher: every aten op on a DTensor comes through ``dispatch``.

HOT PATH. This module is written for speed: one pass over the arguments builds
both the local arguments and the cache key, the cached propagation says whether
anything must move, and outputs are wrapped with specs that were computed once.
No tree_map, no schema comparison, no per-call allocation that a cache avoids.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_leaves, tree_map_only  # off the hot path: cross-mesh calls only

from shardprop.dispatch import answers as _answers
from shardprop.dispatch import hooks as _hooks_mod
from shardprop.dispatch import outside as _outside
from shardprop.dispatch import plain_tensors as _plain
from shardprop.dispatch import propagate as _prop
from shardprop.dispatch import registry as _registry
from shardprop.dispatch.plain_tensors import (  # noqa: F401  (PlainTensorError, same_on_every_rank: public here too)
    PlainTensorError,
    plain_tensor_error,
    same_on_every_rank,
)
from shardprop.dispatch.registry import (  # noqa: F401  (the dispatcher's own names for them)
    call_counts,
    register_positionwise,
    register_special,
    reset_counts,
    special_handler,
    unregister_special,
)
from shardprop.dispatch.op_schema import COMPLEX, FLOAT, OpSchema, ScalarTensor, _marker
from shardprop.mesh import device_mesh as _dm
from shardprop.tensor import dtensor as _dt
from shardprop.tensor.redistribute import run_plan

DTensor = _dt.DTensor
_Tensor = torch.Tensor
_make_subclass = torch.Tensor._make_wrapper_subclass
_cache = _answers.cache  # the propagation cache: each op's answers in its entry's memo, bounded in all
_inference_mode_enabled = torch.is_inference_mode_enabled
_TRUE = _marker("<True>")
_FALSE = _marker("<False>")
_scalar_keys = {}
_float_kwargs = {}  # kwarg names -> the key of those kwargs when all are floats

# op -> its OpEntry (registry.py): one dict lookup per call gives all the op's facts.
_entries = _registry.entries
_entry = _registry.entry
_UNASKED = _registry.UNASKED
_NOT_SPLIT = _marker("<not split>")

# The hooks other rooms plug in (recorder, explicit mode, implicit replication, first-call hook): see hooks.py.
_hooks = _hooks_mod.hooks


def wrap(local: torch.Tensor, spec) -> "DTensor":
    """A DTensor over ``local`` with ``spec`` (no autograd history)."""
    m = spec.tensor_meta
    r = _make_subclass(DTensor, m.shape, strides=m.stride, dtype=m.dtype, device=local.device)
    r._local_tensor = local
    r._spec = spec
    return r


def _flatten(seq, largs: list, key: list) -> None:
    """Append each argument's local form to ``largs`` and its cache-key form to ``key``."""
    for a in seq:
        t = type(a)
        if t is DTensor:
            largs.append(a._local_tensor)
            key.append(a._spec)
        elif t is int or a is None or t is str:
            largs.append(a)
            key.append(a)
        elif t is float:
            largs.append(a)
            key.append(FLOAT)
        elif t is list or t is tuple:
            for x in a:  # sizes and dims (all ints) pass as they are: no sub-lists to build
                if type(x) is not int:
                    break
            else:
                largs.append(a)
                key.append(tuple(a) if t is list else a)
                continue
            sub_l, sub_k = [], []
            _flatten(a, sub_l, sub_k)
            largs.append(sub_l)
            key.append(tuple(sub_k))
        elif t is bool:
            largs.append(a)
            key.append(_TRUE if a else _FALSE)
        elif isinstance(a, _Tensor):
            if isinstance(a, DTensor):  # a subclass of DTensor (e.g. nn.Parameter over one)
                largs.append(a._local_tensor)
                key.append(a._spec)
            elif a.ndim == 0:
                k = _scalar_keys.get((a.dtype, a.device))
                if k is None:
                    k = _scalar_keys[(a.dtype, a.device)] = ScalarTensor(a.dtype, a.device)
                largs.append(a)
                key.append(k)
            else:
                raise plain_tensor_error(a)
        elif t is complex:
            largs.append(a)
            key.append(COMPLEX)
        else:  # dtype, device, layout, memory format, ...: hashable as they are
            largs.append(a)
            key.append(a)


def _flatten_kwargs(kwargs):
    """(local kwargs, kwargs key) for kwargs that hold more than floats."""
    vals, kkey = [], []
    _flatten(kwargs.values(), vals, kkey)
    return dict(zip(kwargs.keys(), vals)), tuple(zip(kwargs.keys(), kkey))


def dispatch(op, args=(), kwargs=None):
    """Run aten ``op`` on DTensor arguments: propagate (cached), redistribute if needed, compute, wrap.

    Example:
        >>> dispatch(torch.ops.aten.mm.default, (a, b))  # a, b DTensors  # doctest: +SKIP
    """
    return torch_dispatch(DTensor, op, (), args, kwargs)


def torch_dispatch(cls, op, types, args=(), kwargs=None):
    """DTensor.__torch_dispatch__: special handlers first, else the rule-based path."""
    e = _entries.get(op)
    if e is None:
        e = _entry(op)
    handler = e.special
    if handler is not None:
        if handler is _UNASKED:  # the op's first dispatch: decide on its special handler once
            return _first_call(op, args, kwargs, e)
        if _dm.flags.excluded_from_some_mesh and not e.outside_safe:
            mesh = _outside.excluded_mesh(args, kwargs)
            if mesh is not None:
                return _special_outside(op, args, kwargs, e, mesh)
        return handler(op, args, kwargs)
    e.calls += 1
    return run(op, args, kwargs, None, e)


def _first_call(op, args, kwargs, e):
    """torch_dispatch at ``op``'s first call: settle its special handler (first-call hook), then dispatch."""
    _registry.settle_special(e)
    return torch_dispatch(DTensor, op, (), args, kwargs)


def _special_outside(op, args, kwargs, rec, mesh):
    """A special op on a rank outside ``mesh``: its handler would communicate; run it as a no-op instead."""
    res = _outside.special_result(op, args, kwargs, mesh)
    if res is not None:
        return res
    if rec.rule is not None:
        return run(op, args, kwargs, None, rec)  # the rule gives the specs; its outside form computes nothing
    return _outside.shaped_like_meta(op, args, kwargs, mesh)


def run(op, args, kwargs=None, compute=None, rec=None):
    """The rule-based path: flatten once, propagate (cached), redistribute if needed, compute, wrap.

    ``compute(op, out, largs, lkwargs)`` (for special handlers) replaces the local call.

    Example:
        >>> run(aten.embedding.default, (w, idx), {}, compute=masked_lookup)  # doctest: +SKIP
    """
    largs, key = [], []
    try:  # free when nothing raises (Python 3.11 zero-cost exceptions): the hot path is unchanged
        _flatten(args, largs, key)
        if kwargs:
            for v in kwargs.values():
                if type(v) is not float:
                    lkwargs, kkey = _flatten_kwargs(kwargs)
                    break
            else:  # only floats (alpha=, value=): passed on as they are, the key cached per names
                lkwargs = kwargs
                kkey = _float_kwargs.get(tuple(kwargs))
                if kkey is None:
                    kkey = _float_kwargs[tuple(kwargs)] = tuple((name, FLOAT) for name in kwargs)
        else:
            lkwargs = {}
            kkey = ()
    except PlainTensorError:
        return _run_with_plain_tensors(op, args, kwargs, compute, rec)
    if rec is None:
        rec = _entries.get(op) or _entry(op)
    # The op's memo is the propagation cache: a hit needs no OpSchema; a miss propagates and remembers.
    key = (tuple(key), kkey)
    try:
        out = rec.memo.get(key)
        if out is None:
            out = _miss(op, key, rec)
    except TypeError:  # symbolic sizes (torch.compile, dynamic shapes) do not hash: propagate uncached
        out = _uncached(op, key, rec)
    except _prop.MeshMismatchError as err:
        return _run_over_meshes(op, args, kwargs, compute, rec, err)
    if out.needs_redistribute:
        schema = OpSchema(op, key[0], kkey, rec.hash)
        largs, lkwargs = _redistribute_inputs(op, args, kwargs, out, schema, rec.written)
        if rec.guard_view:
            return _copied_view(op, args, out, schema, compute or out.local_call, rec, largs, lkwargs)
    if _hooks.recorder is not None:
        _hooks.recorder.record(OpSchema(op, key[0], kkey, rec.hash), out)
    if compute is None or out.outside:  # outside the mesh, even a special handler's compute gives way
        compute = out.local_call
    res = rec.call(*largs, **lkwargs) if compute is None else compute(op, out, largs, lkwargs)
    returns = out.returns
    if returns == "tensor" or (returns == "view" and not _inference_mode_enabled()):
        # wrap() inlined: the common case, on the hot path (the other kinds: _RESULTS)
        spec = out.out_specs[0]
        m = spec.tensor_meta
        r = _make_subclass(DTensor, m.shape, strides=m.stride, dtype=m.dtype, device=res.device)
        r._local_tensor = res
        r._spec = spec
        return r
    return _RESULTS[returns](op, res, out, args, kwargs, rec)


# ---------------------------------------------------------------- run's steps off the hot path


def _miss(op, key, rec):
    """The answer for a call the op's memo does not hold: propagated (outside the mesh: its no-op form), remembered."""
    out = _prop.propagate_miss(OpSchema(op, key[0], key[1], rec.hash))
    if _outside.is_outside(out):  # decided once per answer: a hit never asks
        out = _outside.sharding_for(out)
    _cache.remember(rec.memo, key, out)
    return out


def _uncached(op, key, rec):
    """The answer for a call with symbolic sizes, which no cache can hold."""
    out = _prop.propagate_uncached(OpSchema(op, key[0], key[1], rec.hash))
    return _outside.sharding_for(out) if _outside.is_outside(out) else out


def _run_with_plain_tensors(op, args, kwargs, compute, rec):
    """run() for a call holding plain tensors: a list op split by position, or the plain tensors replicated."""
    if rec is None:
        rec = _entry(op)
    if rec.positionwise:
        split = _split_positions(op, args, kwargs, compute, rec)
        if split is not _NOT_SPLIT:
            return split
    args, kwargs = _plain.replicate_plain_indices(args, kwargs, rec.written)  # raises for differing ones
    return run(op, args, kwargs, compute, rec)


def _run_over_meshes(op, args, kwargs, compute, rec, err):
    """run() for a call whose DTensors live on several meshes: one call per mesh, or 0-dim values joined."""
    if rec.positionwise:  # a list op over parameters of several meshes: one call per mesh
        split = _split_positions(op, args, kwargs, compute, rec)
        if split is not _NOT_SPLIT:
            return split
    if _all_scalars((args, kwargs)):
        return _run_on_values(op, args, kwargs)
    raise err


def _result_view(op, res, out, args, kwargs, rec):
    return _wrap_view(res, out, args[0], True)  # under inference mode (else run wraps it inline)


def _result_view_list(op, res, out, args, kwargs, rec):
    return _wrap_view(res, out, args[0], False)


def _result_self(op, res, out, args, kwargs, rec):
    base = getattr(args[0], "_view_base", None)  # a list for the _foreach_*_ ops
    if base is not None and base() is not None:
        raise _write_into_copy_error(op, args[0])
    return args[0] if res is not None else None


def _result_list(op, res, out, args, kwargs, rec):
    return [r if s is None else wrap(r, s) for r, s in zip(res, out.out_specs)]


def _result_tuple(op, res, out, args, kwargs, rec):
    return tuple(_result_list(op, res, out, args, kwargs, rec))


def _result_out(op, res, out, args, kwargs, rec):
    return _written(rec.written, kwargs)


def _result_none(op, res, out, args, kwargs, rec):
    return res


# OutputSharding.returns -> how run() turns the local result into the op's result (a one-tensor result
# is wrapped inline in run: the common case).
_RESULTS = {"view": _result_view, "view_list": _result_view_list, "self": _result_self, "list": _result_list,
            "tuple": _result_tuple, "out": _result_out, "none": _result_none}


# ---------------------------------------------------------------- slow path


def _wrap_view(res, out, base, single: bool):
    """Wrap what a view op returned (one tensor, or a list).

    Under ``torch.inference_mode()`` torch makes a view of a normal tensor a normal tensor, and
    autograd's view tracking (which runs after us for a normal base) then shares the base's
    version counter with it: a wrapper made in inference mode has none and refuses. So the
    wrappers are made with inference mode off in that case, as torch would make the view.
    """
    if _inference_mode_enabled() and isinstance(base, _Tensor) and not base.is_inference():
        with torch.inference_mode(False):
            return _wrap_view(res, out, base, single)
    if single:
        return wrap(res, out.out_specs[0])
    return [r if s is None else wrap(r, s) for r, s in zip(res, out.out_specs)]


def _copied_view(op, args, out, schema, compute, rec, largs, lkwargs):
    """Run a view op whose input had to move first: its result is a copy, not a view.

    torch would let ``x[:, 0] = 7`` write through the view into ``x``; a copy cannot, so
    each output remembers its base (weakly) and an in-place op on it raises while the base
    is alive, instead of silently leaving the base unchanged. Once the base is gone (e.g.
    an intermediate gradient that autograd later accumulates into) nothing can tell.
    """
    if _hooks.recorder is not None:
        _hooks.recorder.record(schema, out)
    res = rec.call(*largs, **lkwargs) if compute is None else compute(op, out, largs, lkwargs)
    single = out.returns == "view"
    wrapped = _wrap_view(res, out, args[0], single)
    wrapped = [wrapped] if single else wrapped
    base = weakref.ref(args[0]) if isinstance(args[0], DTensor) else None
    for w in wrapped:
        if isinstance(w, DTensor):
            w._view_base = base
            w._view_op = op
    return wrapped[0] if single else wrapped


def _write_into_copy_error(op, target) -> Exception:
    base = target._view_base()
    return _prop.ShardingError(
        f"shardprop: {op} writes in place into the result of {target._view_op}, which is a copy, not a view: "
        f"its input {list(base.placements)} {tuple(base.shape)} had to be redistributed first, so the write "
        "would not reach the base tensor as it does in torch. Redistribute the base so the view keeps its "
        "shards (e.g. x = x.redistribute(placements=[Replicate()])) before writing through the view, or "
        ".clone() the view if the base need not change.")


def _split_positions(op, args, kwargs, compute, rec):
    """Run a POSITIONWISE op as one call per group of positions: plain, and each mesh's.

    Positions where no list holds a DTensor run as plain torch, so an optimizer over a model whose
    norms stay plain tensors takes ``foreach=True`` or ``fused=True``. Positions of each mesh run
    through the rule-based path on their own (their plain 0-d tensors, such as optimizer steps, are
    replicated as always): ``fully_shard`` over dp beside TP on a (dp, tp) mesh leaves parameters on
    two meshes, and an optimizer or ``clip_grad_norm_`` puts them all in one list op. Results keep
    their positions. Returns _NOT_SPLIT when there is one group only, when one position mixes
    meshes, or when a DTensor outside the lists would have to join every group (the caller's error
    path).

    Example:
        >>> torch._foreach_mul_([dtensor_w, plain_w, w_on_dp_mesh], 0.5)  # doctest: +SKIP
    """
    lists = [j for j, a in enumerate(args) if type(a) in (list, tuple)]
    if not lists or any(isinstance(a, DTensor) for j, a in enumerate(args) if j not in lists):
        return _NOT_SPLIT
    n = len(args[lists[0]])
    full = [j for j in lists if len(args[j]) == n]
    groups = {}  # mesh (None: plain) -> positions
    for i in range(n):
        meshes = {args[j][i]._spec.mesh for j in full if isinstance(args[j][i], DTensor)}
        if len(meshes) > 1:
            return _NOT_SPLIT
        groups.setdefault(meshes.pop() if meshes else None, []).append(i)
    if len(groups) < 2:
        return _NOT_SPLIT

    def pick(idx):
        return tuple([args[j][i] for i in idx] if j in full else a for j, a in enumerate(args))

    plain_op = getattr(op, "_op", op)
    results = [(idx, plain_op(*pick(idx), **(kwargs or {})) if mesh is None
                else run(op, pick(idx), kwargs, compute, rec)) for mesh, idx in groups.items()]
    if results[0][1] is None:  # in place: nothing to merge
        return None
    merged = [None] * n
    for idx, part in results:
        for i, r in zip(idx, part):
            merged[i] = r
    return merged


def _all_scalars(tree) -> bool:
    """Whether every DTensor in ``tree`` (nested lists, tuples, dicts) is 0-dim."""
    return all(a.ndim == 0 for a in tree_leaves(tree) if isinstance(a, DTensor))


def _run_on_values(op, args, kwargs):
    """Run ``op`` on the values of 0-dim DTensors of several meshes; plain results.

    Per-mesh norms joined into one (``clip_grad_norm_`` stacks the norm of each parameter group):
    each scalar is reduced on its own mesh (every rank then holds the value), and the result, owned by
    no single mesh, is a plain tensor, the same on every rank; it joins later DTensor ops as a scalar.

    Example:
        >>> torch.stack([norm_on_mesh_a, norm_on_mesh_b])  # doctest: +SKIP
        tensor([...])
    """
    args, kwargs = tree_map_only(DTensor, lambda d: d.full_tensor(), (args, kwargs or {}))
    return getattr(op, "_op", op)(*args, **kwargs)


def _redistribute_inputs(op, args, kwargs, out, schema, written):
    """Rebuild the local arguments with each input moved to the layout the strategy needs."""
    if _hooks.explicit_mode is not None:
        _hooks.explicit_mode(schema, out)
    it = iter(zip(out.in_specs, out.plans))

    def local_of(a):
        t = type(a)
        if isinstance(a, DTensor):
            spec, plan = next(it)
            return a._local_tensor if plan is None else run_plan(a._local_tensor, a._spec, plan)
        if t is list or t is tuple:
            return [local_of(x) for x in a]
        return a

    largs = [local_of(a) for a in args]
    if out.returns == "self" and out.plans and out.plans[0] is not None and isinstance(args[0], DTensor):
        # A Partial in-place target reduced first (see propagate._choose_per_dim): it now holds the
        # reduced value, and the op writes into that.
        args[0]._local_tensor = largs[0]
        args[0]._spec = out.in_specs[0]
    lkwargs = {}
    for k, v in (kwargs or {}).items():
        if k in written:  # written, not read: never redistributed
            lkwargs[k] = _dt_local(v)
        else:
            lkwargs[k] = local_of(v)
    return largs, lkwargs


def _written(names, kwargs):
    """What an out= variant returns: the DTensor(s) it wrote into (``names``: its written kwargs)."""
    return kwargs[names[0]] if len(names) == 1 else tuple(kwargs[n] for n in names)


def _dt_local(v):
    if isinstance(v, DTensor):
        return v._local_tensor
    if isinstance(v, (list, tuple)):
        return [_dt_local(x) for x in v]
    return v

