"""``_foreach_*`` ops (what torch.optim and clip_grad_norm_ call with foreach=True).

A foreach op is N independent ops: position i of the output depends only on
position i of each list argument. So the rule does not invent placements: it
builds the per-element call (``_foreach_add_.List`` at i is ``add_.Tensor`` on
the i-th elements), asks that op's own rule through the cached ``propagate``,
and stitches the N answers into one option. Every element thereby gets exactly
the layouts its pointwise/reduction rule would give (Partial handling included),
and the local call stays one fused ``_foreach_*`` on the shards.

The rule is a full (per_dim=False) rule: one option whose entries are whole
placement tuples, because each element needs its own placements on every mesh dim
(a per-dim option list is shared by all mesh dims and could only express this by
enumerating combinations).
"""
from __future__ import annotations

import functools

import torch

from shardprop.dispatch import dispatcher
from shardprop.dispatch import propagate as _prop
from shardprop.dispatch import registry
from shardprop.dispatch.op_schema import OpSchema
from shardprop.dispatch.registry import rule
from shardprop.tensor.placement import is_shard_like
from shardprop.tensor.spec import DTensorSpec

aten = torch.ops.aten

UNARY = [
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1", "floor", "frac",
    "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign", "sin",
    "sinh", "sqrt", "tan", "tanh", "trunc", "zero", "clone", "copy", "max",
]
BINARY = ["add", "sub", "mul", "div", "maximum", "minimum", "clamp_min", "clamp_max", "pow", "lerp", "addcmul",
          "addcdiv", "norm"]

# Which overload of the element op serves a foreach overload, by the foreach overload's name.
# (First existing one wins.)
_OVERLOAD = {
    "List": ("Tensor", "default"),
    "Scalar": ("Scalar", "default"),
    "ScalarList": ("Scalar", "default"),
    "Tensor": ("Tensor", "default"),
    "default": ("default",),
}
# Exceptions: (foreach name, overload) -> (element packet name, overload(s), element arg names that the
# foreach op's positional args bind to; None = the element schema's own order).
_EXCEPTIONS = {
    ("maximum", "Scalar"): ("clamp_min", "default", None),
    ("maximum", "ScalarList"): ("clamp_min", "default", None),
    ("minimum", "Scalar"): ("clamp_max", "default", None),
    ("minimum", "ScalarList"): ("clamp_max", "default", None),
    ("pow", "List"): ("pow", ("Tensor_Tensor", "Tensor"), None),  # pow_ names its overloads differently
    ("pow", "Scalar"): ("pow", ("Tensor_Scalar", "Scalar"), None),
    ("pow", "ScalarList"): ("pow", ("Tensor_Scalar", "Scalar"), None),
    ("pow", "ScalarAndTensor"): ("pow", "Scalar", None),
    ("norm", "Scalar"): ("linalg_vector_norm", "default", ("self", "ord", "dtype")),
    ("max", "default"): ("max", "default", None),
}
# Foreach overloads whose element op would need a slice of a 1-d tensor argument (not a list):
# not expressible as one element call; left without a rule.
_SKIP = {("addcmul", "Tensor"), ("addcdiv", "Tensor")}


class _Idx(int):
    """Position of a DTensor spec in the foreach call's ``ctx.specs`` (distinct from a plain int)."""


def element_op(foreach_op):
    """(element OpOverload, positional arg names, list-arg flags) for a foreach overload, or None.

    Example:
        >>> element_op(aten._foreach_add_.List)[0]  # doctest: +SKIP
        aten.add_.Tensor
    """
    return _element_op(foreach_op)


@functools.lru_cache(maxsize=None)
def _element_op(foreach_op):
    packet = foreach_op.overloadpacket.__name__  # "_foreach_add_"
    inplace = packet.endswith("_")
    base = packet[len("_foreach_"):].rstrip("_")
    ov = foreach_op._overloadname
    if (base, ov) in _SKIP:
        return None
    if (base, ov) in _EXCEPTIONS:
        name, eov, names = _EXCEPTIONS[(base, ov)]
        cands = eov if isinstance(eov, tuple) else (eov,)
    else:
        name, names, cands = base, None, _OVERLOAD.get(ov, ())
    epacket = getattr(aten, name + ("_" if inplace else ""), None)
    if epacket is None and inplace:  # no in-place element op (maximum_): the functional one, output kept on self
        epacket = getattr(aten, name, None)
    if epacket is None:
        return None
    for c in cands:
        if c in epacket.overloads():
            eop = getattr(epacket, c)
            break
    else:
        return None
    fargs = foreach_op._schema.arguments
    eargs = eop._schema.arguments
    if names is None:
        names = tuple(a.name for a in eargs[:len([a for a in fargs if not a.kwarg_only])])
    kwarg_only = {a.name for a in eargs if a.kwarg_only}
    is_list = tuple(isinstance(a.type, torch.ListType) for a in fargs if not a.kwarg_only)
    return eop, tuple(names), is_list, frozenset(kwarg_only)


def _index_specs(x, counter):
    """``x`` with every DTensorSpec replaced by (_Idx(position), spec), positions in ctx.specs order."""
    if type(x) is DTensorSpec:
        i = counter[0]
        counter[0] += 1
        return (_Idx(i), x)
    if type(x) is tuple:
        return tuple(_index_specs(v, counter) for v in x)
    return x


def _split(x, positions: list, override: dict):
    """Undo _index_specs on one element argument, recording each spec's parent position."""
    if type(x) is tuple and len(x) == 2 and type(x[0]) is _Idx:
        positions.append(int(x[0]))
        return override.get(int(x[0]), x[1])
    if type(x) is tuple:
        return tuple(_split(v, positions, override) for v in x)
    return x


def _element_calls(ctx, info, override=None):
    """[(sub OpSchema, parent spec positions)] for every list position.

    ``override`` maps parent spec positions to the spec the elements should see instead.
    """
    override = override or {}
    eop, names, is_list, kwarg_only = info
    counter = [0]
    args = _index_specs(ctx.args, counter)
    kwargs = {k: _index_specs(v, counter) for k, v in ctx.kwargs.items()}
    lengths = {len(a) for a, lst in zip(args, is_list) if lst}
    if len(lengths) != 1:
        raise _prop.ShardingError(f"{ctx.op}: list arguments of different lengths {sorted(lengths)}")
    n = lengths.pop()
    calls = []
    for i in range(n):
        pos_args, kw = [], {}
        for a, lst, name in zip(args, is_list, names):
            v = a[i] if lst else a
            if name in kwarg_only:
                kw[name] = v
            else:
                pos_args.append(v)
        kw.update(kwargs)
        positions = []
        sub_args = tuple(_split(a, positions, override) for a in pos_args)
        sub_kwargs = tuple((k, _split(v, positions, override)) for k, v in kw.items())
        calls.append((OpSchema(eop, sub_args, sub_kwargs), positions))
    return calls


def _propagate_elements(ctx, calls, held=frozenset()):
    """Per-input and per-output placements from each element's rule; and the shared inputs in conflict.

    ``held``: parent spec positions that must stay as they are (already replicated shared inputs).
    """
    n_specs = len(ctx.specs)
    ins = [None] * n_specs
    outs = []
    conflict = set()
    emulated = ctx.returns == "self" and calls and _prop._op_alias(calls[0][0].op) != "self"
    for sub, positions in calls:
        fixed = {k for k, p in enumerate(positions) if p in held}
        if emulated or fixed:
            in_pl, out_pl = _choose_with(sub, emulated or _prop._op_alias(sub.op) == "self", fixed)
        else:
            res = _prop.cache.fn(sub)
            if res.local_call is not None:
                raise _prop.ShardingError(f"{ctx.op}: element op {sub.op} needs a custom local call; "
                                          "a fused foreach call cannot run it")
            in_pl = [s.placements for s in res.in_specs]
            out_pl = [None if s is None else s.placements for s in res.out_specs]
        for p, pl in zip(positions, in_pl):
            if ins[p] is not None and ins[p] != pl:
                conflict.add(p)
            ins[p] = pl
        outs.extend(out_pl)
    return ins, outs, conflict


def _is_replicate(entry) -> bool:
    return all(p.is_replicate() for p in (entry if isinstance(entry, (tuple, list)) else (entry,)))


def _choose_with(sub, keep_self: bool, fixed: set):
    """The engine's choice for one element with constraints propagate() cannot express: the first
    input held (a functional op standing in for a missing in-place one, maximum_), and the inputs
    in ``fixed`` kept Replicate (a shared 0-d operand all elements must agree on)."""
    ectx = _prop.PropContext(sub)
    r = registry.lookup(sub.op)
    if r is None:
        raise _prop.ShardingError(f"{sub.op} has no sharding rule")
    options = [_prop._norm_option(o, len(ectx.specs), str(sub.op)) for o in r.fn(ectx)]
    options = [o for o in options if all(_is_replicate(o[0][k]) for k in fixed)]
    if not options:
        raise _prop.ShardingError(f"{sub.op}: no strategy with {sorted(fixed)} replicated")
    choose = _prop._choose_per_dim if r.per_dim is True else _prop._choose_full
    in_pl, out_pl, _ = choose(ectx, options, keep_self)
    return [tuple(p) for p in in_pl], [None if p is None else tuple(p) for p in out_pl]


def _replicated(spec: DTensorSpec) -> DTensorSpec:
    from shardprop.tensor.placement import Replicate
    return spec.with_placements(tuple(Replicate() for _ in spec.placements))


def foreach_options(ctx):
    """One option: each list position placed as its element op's rule places it."""
    if ctx.op == aten._foreach_norm.Scalar:
        return norm_options(ctx)
    info = _element_op(ctx.op)
    if info is None:
        raise _prop.ShardingError(f"{ctx.op}: no element op known for this foreach overload")
    calls = _element_calls(ctx, info)
    ins, outs, conflict = _propagate_elements(ctx, calls)
    if conflict:
        # A DTensor shared by all elements (a 0-d scale) that the elements want placed differently:
        # replicate it once for all (always acceptable for a 0-d operand) and ask again.
        override = {p: _replicated(ctx.specs[p]) for p in conflict}
        ins, outs, conflict = _propagate_elements(ctx, _element_calls(ctx, info, override), frozenset(conflict))
        if conflict:
            raise _prop.ShardingError(f"{ctx.op}: the list elements need a shared input placed differently")
    if ctx.returns == "self":  # in-place: no outputs; the engine checks the target keeps its layout
        outs = [ctx.specs[0].placements] * len(ctx.out_metas)
    elif len(outs) != len(ctx.out_metas):
        raise _prop.ShardingError(f"{ctx.op}: {len(outs)} element outputs for {len(ctx.out_metas)} results")
    return [(tuple(ins), tuple(outs))]


# ------------------------------------------------------------ _foreach_norm
# A vector p-norm of a sharded tensor is not a sum of shard norms, and no Partial placement
# holds "sum of p-th powers": the element rule (linalg_vector_norm) must gather every shard.
# clip_grad_norm_ calls this on every gradient, so instead the norms are finished here: each
# rank takes its shard's sum of |x|^p (max/min for +-inf), one all-reduce per group of
# elements sharded on the same mesh dims combines them, and the p-th root makes a replicated
# norm. Inputs stay where they are, except Partial dims (a partial sum has no local norm),
# which are replicated first.

def norm_options(ctx):
    """Each list element keeps its shards (Partial -> Replicate); every norm comes out Replicate."""
    from shardprop.tensor.placement import Replicate
    ins = tuple(tuple(Replicate() if p.is_partial() else p for p in s.placements) for s in ctx.specs)
    outs = tuple(tuple(Replicate() for _ in ctx.mesh.shape) for _ in ctx.out_metas)
    return [(ins, outs)]


def _norm_local(op, out, largs, lkwargs):
    """Finish ``_foreach_norm`` across shards: local power sums, one all-reduce per group, root."""
    from shardprop.mesh import collectives as C
    tensors = largs[0]
    ord_ = largs[1] if len(largs) > 1 else lkwargs.get("ord", 2)
    dtype = largs[2] if len(largs) > 2 else lkwargs.get("dtype")
    p = float(ord_)
    reduce_op = "max" if p == float("inf") else "min" if p == float("-inf") else "sum"
    results, groups = [], {}
    for i, (t, spec) in enumerate(zip(tensors, out.in_specs)):
        x = t if dtype is None else t.to(dtype)
        if x.numel() == 0 and reduce_op == "sum":  # no elements: nothing to add (and no 0 ** -p)
            local = torch.zeros((), dtype=x.dtype)
        elif reduce_op == "sum":
            local = torch.linalg.vector_norm(x, p) ** p if p != 0 else (x != 0).sum().to(x.dtype)
        elif x.numel() == 0:  # norms are >= 0: an empty shard is neutral for max; +inf for min
            local = torch.zeros((), dtype=x.dtype) if p > 0 else torch.full((), float("inf"), dtype=x.dtype)
        else:
            local = torch.linalg.vector_norm(x, p)
        results.append(local)
        dims = tuple(m for m, pl in enumerate(spec.placements) if is_shard_like(pl))  # strided shards too
        if dims:
            groups.setdefault(dims, []).append(i)
    for dims, idx in groups.items():
        combined = C.all_reduce(torch.stack([results[i] for i in idx]), out.in_specs[idx[0]].mesh, dims, reduce_op)
        for k, i in enumerate(idx):
            results[i] = combined[k]
    if reduce_op == "sum" and p not in (0.0, 1.0):
        results = [r ** (1.0 / p) for r in results]
    return [r.reshape(()).to(s.tensor_meta.dtype) for r, s in zip(results, out.out_specs)]


def _foreach_overloads():
    out = []
    for base in UNARY + BINARY:
        for suffix in ("", "_"):
            packet = getattr(aten, f"_foreach_{base}{suffix}", None)
            if packet is None:
                continue
            for ov in packet.overloads():
                op = getattr(packet, ov)
                if "out" in ov or _element_op(op) is None:
                    continue
                out.append(op)
    return out


FOREACH_OPS = _foreach_overloads()
rule(*FOREACH_OPS, per_dim=False, strided=True)(foreach_options)
dispatcher.register_positionwise(FOREACH_OPS)  # lists mixing plain tensors and DTensors: split by position
registry.register_local_call(aten._foreach_norm.Scalar, _norm_local)
