"""Sharding propagation: from an OpSchema to an OutputSharding, cached.

On a miss the op's rule lists acceptable options; each is priced by the
redistribution its inputs would need (the planner's own cost table) and the
cheapest wins. Ties go to the option the rule listed first, so every rank picks
the same. Output tensor meta comes from running the op once on meta tensors.
"""
from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Callable, List, Optional

import torch

from shardprop.dispatch import out_targets, registry
from shardprop.dispatch.answers import CacheInfo, cache, runs_outside  # noqa: F401  (propagate's names too)
from shardprop.mesh import config as _config
from shardprop.mesh.config import values as _settings
from shardprop.dispatch.op_schema import (
    COMPLEX,
    FLOAT,
    Candidate,
    OpSchema,
    OutputSharding,
    ScalarTensor,
    _Marker,
)
from shardprop.dispatch.strided_inputs import is_pointwise, unstrided
from shardprop.tensor.placement import Replicate, Shard, has_strided
from shardprop.tensor.redistribute import (
    local_bytes,
    plan_redistribute,
    transition_cost,
)
from shardprop.tensor.spec import DTensorSpec, TensorMeta


# Callables op -> str that add advice to the no-rule error; set by rooms that can serve such ops
# (decompose.py adds the decomposition opt-in), so this module never imports them.
no_rule_hints: List[Callable[[object], str]] = []


class ShardingError(RuntimeError):
    """An op cannot run with the given placements (no rule, or no acceptable option).

    Example:
        >>> x = distribute_tensor(torch.ones(8), init_device_mesh("cpu", (4,)), [Shard(0)])
        >>> y = distribute_tensor(torch.ones(8), init_device_mesh("cpu", (2, 2)), [Shard(0), Replicate()])
        >>> try:
        ...     x + y                       # two meshes: no option can run it
        ... except ShardingError as e:
        ...     print(type(e).__name__)
        MeshMismatchError
    """


class MeshMismatchError(ShardingError):
    """An op's DTensor inputs live on different meshes (list ops split such calls per mesh)."""


class PropContext:
    """What a rule sees: the op, its arguments (specs for DTensors), and output meta.

    Example:
        >>> ctx.specs[0].placements, ctx.out_metas[0].shape  # doctest: +SKIP
    """

    def __init__(self, schema: OpSchema, cached: bool = True):
        self.schema = schema
        self.cached = cached
        self.op = schema.op
        self.args = schema.args
        self.kwargs = schema.kwargs_dict
        specs = schema.specs
        written = written_kwargs(schema.op)
        if written:  # out= tensors are written, not read: not the rule's inputs
            for name in written:
                self.kwargs.pop(name, None)
            specs = OpSchema(schema.op, schema.args, tuple(self.kwargs.items())).specs
        self.specs = specs
        self.mesh = specs[0].mesh if specs else None
        self._out_metas = None

    @property
    def out_metas(self) -> tuple:
        """TensorMeta (or None) of each top-level output, from one run on meta tensors."""
        if self._out_metas is None:
            key = _meta_key(self.schema)
            if not self.cached:
                self._out_metas, self._returns = meta_run(key)
            elif key.cacheable:
                self._out_metas, self._returns = _meta_cached(key)
            else:  # symbolic sizes: the dispatcher retries with propagate_uncached, caching nothing
                raise TypeError("symbolic sizes: not cacheable")
        return self._out_metas

    @property
    def returns(self) -> str:
        self.out_metas
        return self._returns


# ------------------------------------------------------------ meta execution
def _to_meta(a):
    t = type(a)
    if t is DTensorSpec or t is TensorMeta:
        m = a.tensor_meta if t is DTensorSpec else a
        return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")
    if t is tuple:
        return [_to_meta(x) for x in a]
    if t is ScalarTensor:
        return torch.zeros((), dtype=a.dtype, device="meta")
    if a is FLOAT:
        return 0.5
    if a is COMPLEX:
        return 0.5j
    if t is torch.device:
        return torch.device("meta")
    if t is _Marker:
        return _MARKER_VALUES[a.name]
    return a


_MARKER_VALUES = {"<True>": True, "<False>": False, "<float>": 0.5, "<complex>": 0.5j}


def _meta_of(t) -> Optional[TensorMeta]:
    if isinstance(t, torch.Tensor):
        return TensorMeta(t.shape, t.stride(), t.dtype)
    return None


def _strip(a):
    t = type(a)
    if t is DTensorSpec:
        return a.tensor_meta
    if t is tuple:
        return tuple(_strip(x) for x in a)
    return a


def _meta_key(schema: OpSchema) -> OpSchema:
    """The schema with placements dropped: output shapes do not depend on them."""
    return OpSchema(schema.op, _strip(schema.args), tuple((k, _strip(v)) for k, v in schema.kwargs))


@functools.lru_cache(maxsize=16384)
def _meta_cached(key: OpSchema):
    return meta_run(key)


def meta_run(schema: OpSchema):
    """Run the op on meta tensors: (output metas, how the result is returned)."""
    op = schema.op
    schema_returns = getattr(getattr(op, "_schema", None), "returns", None)
    if schema_returns is not None and len(schema_returns) == 0:
        # Returns nothing: no output meta to infer, and some such kernels have no meta version
        # (_fused_sgd_); their rules check the arguments themselves.
        return (), returns_kind(op, None)
    args = [_to_meta(a) for a in schema.args]
    kwargs = {k: _to_meta(v) for k, v in schema.kwargs}
    try:
        out = (registry.entry(op).output_meta or op)(*args, **kwargs)
    except Exception as e:
        raise ShardingError(f"{op}: could not infer output shapes on meta tensors ({type(e).__name__}: {e})") from e
    returns = returns_kind(op, out)
    if isinstance(out, (tuple, list)):
        return tuple(_meta_of(o) for o in out), returns
    return (_meta_of(out),), returns


def _op_alias(op):
    """('self' | 'out' | None) from the op's schema: does it write into its first argument, or out=? (its entry's)"""
    return registry.entry(op).alias


def written_kwargs(op) -> tuple:
    """Names of the keyword-only arguments ``op`` writes into (``out``, ``values``/``indices``, ...): its entry's."""
    return registry.entry(op).written


def returns_kind(op, out) -> str:
    alias = _op_alias(op)
    if alias is not None:
        return alias
    if isinstance(out, torch.Tensor):
        return "tensor"
    if isinstance(out, tuple):
        return "tuple"
    if isinstance(out, list):
        return "list"
    return "none"


# ------------------------------------------------------------ selection
def _norm_option(opt, n_in: int, where: str):
    if not isinstance(opt, (tuple, list)) or len(opt) != 2:
        raise ShardingError(f"{where}: each option must be (input_placements, output_placements), got {opt!r}")
    ins, outs = opt
    ins, outs = tuple(ins), tuple(outs)
    if len(ins) != n_in:
        raise ShardingError(f"{where}: option {opt!r} gives {len(ins)} input placements for {n_in} DTensor inputs")
    return ins, outs


def _user_options(ctx: PropContext, options, where: str) -> list:
    """A user rule's options with one input entry per DTensor input (the engine's form).

    A user rule may give one entry per DTensor input, or one per argument as given
    (positional, then keyword) with None for non-tensor ones, as torch's rules do; entries
    for ``out=`` tensors are dropped (the engine places those as the outputs). Other
    lengths: the None entries are dropped, as torch drops them.
    """
    n = len(ctx.specs)
    args = None
    out = []
    for opt in options:
        if not isinstance(opt, (tuple, list)) or len(opt) != 2:
            out.append(opt)  # _norm_option says what is wrong
            continue
        ins, outs = tuple(opt[0]), opt[1]
        if ctx.out_metas and ctx.returns != "list" and len(outs) != len(ctx.out_metas):
            # Most often torch's (outputs, inputs) order given to shardprop's (inputs, outputs).
            raise ShardingError(f"{where}: an option gives {len(outs)} output entries for {len(ctx.out_metas)} "
                                f"outputs; shardprop.register_sharding takes (inputs, outputs) pairs, "
                                f"shardprop.experimental.register_sharding torch's (outputs, inputs)")
        if len(ins) == n and not any(p is None for p in ins):
            out.append((ins, outs))
            continue
        if args is None:
            args = _arguments(ctx.schema)
        out.append((_align_inputs(ins, args, n, where), outs))
    return out


def _arguments(schema: OpSchema) -> list:
    """(name, kind, DTensors in it) per argument as given; kind: "in", "list", "written" or "other"."""
    try:
        names = [a.name for a in schema.op._schema.arguments]
    except AttributeError:
        names = []
    written = written_kwargs(schema.op)
    given = [(names[i] if i < len(names) else f"args[{i}]", a) for i, a in enumerate(schema.args)]
    out = []
    for name, a in given + list(schema.kwargs):
        n = 1 if type(a) is DTensorSpec else len(_specs_in(a))
        kind = ("written" if name in written and n else "in" if type(a) is DTensorSpec
                else "list" if n else "other")
        out.append((name, kind, n))
    return out


def _specs_in(a) -> list:
    found = []
    if type(a) is tuple:
        for x in a:
            found.extend([x] if type(x) is DTensorSpec else _specs_in(x))
    return found


def _align_inputs(ins: tuple, args: list, n: int, where: str) -> tuple:
    names = ", ".join(name for name, _, _ in args)
    if len(ins) == len(args):  # one entry per argument: None exactly where there is no DTensor
        picked = []
        for (name, kind, _), p in zip(args, ins):
            if kind == "in":
                if p is None:
                    raise ShardingError(f"{where}: argument {name!r} is a DTensor, but its input entry is None")
                picked.append(p)
            elif kind == "list":
                raise ShardingError(f"{where}: argument {name!r} is a list of DTensors: give one input "
                                    f"entry per DTensor input instead of one per argument")
            elif kind == "other" and p is not None:
                raise ShardingError(f"{where}: argument {name!r} is not a DTensor: its input entry must be "
                                    f"None, got {p!r} (arguments: {names})")
        return tuple(picked)
    given = tuple(p for p in ins if p is not None)
    if len(given) == n:
        return given
    written = [kind == "written" for _, kind, k in args for _ in range(k)]
    if any(written) and len(given) == len(written):  # out= tensors counted as inputs, as torch counts them
        return tuple(p for p, w in zip(given, written) if not w)
    raise ShardingError(f"{where}: an option gives {len(ins)} input entries; expected {n} (one per DTensor "
                        f"input) or {len(args)} (one per argument: {names}; None for non-tensors)")


def _choose_per_dim(ctx: PropContext, options, self_fixed: bool) -> tuple:
    """Pick, for each mesh dim, the cheapest (first on ties) per-dim option."""
    specs = ctx.specs
    mesh = ctx.mesh
    sizes = [local_bytes(s, s.placements) for s in specs]
    chosen_in = [[None] * mesh.ndim for _ in specs]
    chosen_out = None
    candidates = []
    outs_per_dim = []
    for m in range(mesh.ndim):
        k = mesh.shape[m]
        best = None
        # An in-place target keeps its placement; a Partial one that no option keeps (x.add_(eps) on a
        # P(sum) variance) may be reduced in place first: the value is the same, only its layout changes.
        keeps = [specs[0].placements[m]] if self_fixed else [None]
        if self_fixed and specs[0].placements[m].is_partial():
            keeps.append(Replicate())
        for keep in keeps:
            for ins, outs in options:
                if keep is not None and (ins[0] != keep or (outs and outs[0] != keep)):
                    continue
                cost = 0.0
                for i, s in enumerate(specs):
                    cost += transition_cost(s.placements[m], ins[i], sizes[i], k)
                candidates.append(Candidate(m, ins, outs, cost))
                if best is None or cost < best[0]:
                    best = (cost, ins, outs)
            if best is not None:
                break
        if best is None:
            raise ShardingError(f"{ctx.op}: no strategy keeps the in-place target at {list(specs[0].placements)}")
        for i in range(len(specs)):
            chosen_in[i][m] = best[1][i]
        outs_per_dim.append(best[2])
    n_out = len(outs_per_dim[0]) if outs_per_dim else 0
    chosen_out = [tuple(outs_per_dim[m][j] for m in range(mesh.ndim)) for j in range(n_out)]
    return [tuple(c) for c in chosen_in], chosen_out, tuple(candidates)


def _choose_full(ctx: PropContext, options, self_fixed: bool) -> tuple:
    """Pick the cheapest full (n-d) option by the planner's cost of every input's redistribution."""
    specs = ctx.specs
    best = None
    candidates = []
    for ins, outs in options:
        ins = tuple(tuple(p) if isinstance(p, (tuple, list)) else (p,) * ctx.mesh.ndim for p in ins)
        outs = tuple(None if p is None else tuple(p) if isinstance(p, (tuple, list)) else (p,) * ctx.mesh.ndim
                     for p in outs)
        if self_fixed and (ins[0] != specs[0].placements or (outs and outs[0] != specs[0].placements)):
            continue
        cost = sum(plan_redistribute(s, p).cost if s.placements != p else 0.0 for s, p in zip(specs, ins))
        candidates.append(Candidate(-1, ins, outs, cost))
        if best is None or cost < best[0]:
            best = (cost, ins, outs)
    if best is None:
        raise ShardingError(f"{ctx.op}: no strategy keeps the in-place target at {list(specs[0].placements)}")
    return list(best[1]), list(best[2]), tuple(candidates)


def _describe(schema: OpSchema) -> str:
    return ", ".join(f"{list(s.placements)} {tuple(s.shape)}" for s in schema.specs)


def propagate_miss(schema: OpSchema) -> OutputSharding:
    """Propagate ``schema`` afresh, counted as a cache miss of its op (the cache's one way in)."""
    t0 = time.perf_counter()
    ok = False
    try:
        out = _propagate_uncounted(schema)
        ok = True
        return out
    finally:
        e = registry.entry(schema.op)  # the op's cache-miss counters (shardprop.debug.stats reads them)
        e.misses += 1
        e.miss_seconds += time.perf_counter() - t0
        if ok:
            e.inserted += 1


def propagate_uncached(schema: OpSchema) -> OutputSharding:
    """Propagation for a call with symbolic sizes (torch.compile, dynamic shapes): nothing cached.

    The dispatcher comes here only when the cached path raised TypeError (symbolic sizes do
    not hash), so eager calls never pay for the check. Rules see specs whose shapes hold
    SymInts; costs use the sizes' example values, so choosing a strategy adds no guards.

    Example:
        >>> propagate_uncached(OpSchema(aten.relu.default, (symbolic_spec,), ()))  # doctest: +SKIP
    """
    return _propagate_uncounted(schema, cached=False)


def _takes_strided(op) -> bool:
    """Whether ``op``'s rule places strided inputs itself (foreach: per element; fused optimizers)."""
    r = registry.lookup(op)
    return r is not None and r.strided


def _same_layout_pointwise(schema: OpSchema, cached: bool, check_out: bool) -> Optional[OutputSharding]:
    """A pointwise op whose DTensor inputs share one strided layout runs on the aligned locals and keeps it
    (in place too: optimizer updates of fully_shard-ed experts). The rule answers with each strided mesh dim
    as the ``Shard`` of its dim; taken when it keeps inputs and outputs so (exact for a pointwise op,
    whatever the order of the shard's elements). None: the gather path decides."""
    specs = PropContext(schema, cached).specs
    if not is_pointwise(schema.op) or any(s != specs[0] for s in specs[1:]):
        return None
    out = _propagate_uncounted(OpSchema(schema.op, unstrided(schema.args, True), unstrided(schema.kwargs, True)),
                               cached, check_out)
    plain = unstrided(specs[0], True).placements
    if out.needs_redistribute or out.local_call is not None or out.outside or \
            any(o is not None and o.placements != plain for o in out.out_specs):
        return None
    strided = specs[0].placements
    return dataclasses.replace(out, in_specs=tuple(specs), out_specs=tuple(
        None if o is None else o.with_placements(strided) for o in out.out_specs))


def _via_replicate(schema: OpSchema, cached: bool, check_out: bool) -> OutputSharding:
    """Propagation for inputs with a ``_StridedShard``: the rule sees those mesh dims replicated.

    No rule knows strided layouts, so each such input is gathered on those mesh dims first
    (priced and planned as a strided gather); the answer is cached under the strided schema,
    so only misses come here. A strided in-place target or ``out=`` cannot be written through
    a gathered copy: refused.
    """
    plain = OpSchema(schema.op, unstrided(schema.args), unstrided(schema.kwargs))
    out = _propagate_uncounted(plain, cached, check_out)
    specs = PropContext(schema, cached).specs
    written = [v for k, v in schema.kwargs if k in written_kwargs(schema.op)]
    bad = [s for s in ([specs[0]] if out.returns == "self" else []) + [v for v in written if type(v) is DTensorSpec]
           if has_strided(s.placements)]
    if bad:
        raise ShardingError(f"{schema.op}: cannot write in place into a DTensor laid out as {list(bad[0].placements)}; "
                            "redistribute it to Shard/Replicate placements first")
    plans = tuple(None if s.placements == n.placements else plan_redistribute(s, n.placements)
                  for s, n in zip(specs, out.in_specs))
    return dataclasses.replace(out, plans=plans, needs_redistribute=any(p is not None for p in plans))


def _propagate_uncounted(schema: OpSchema, cached: bool = True, check_out: bool = True) -> OutputSharding:
    op = schema.op
    if any(has_strided(s.placements) for s in schema.specs) and not _takes_strided(op):
        # a miss only: the cache-hit path never gets here
        return _same_layout_pointwise(schema, cached, check_out) or _via_replicate(schema, cached, check_out)
    ctx = PropContext(schema, cached)
    if not ctx.specs:
        raise ShardingError(f"{op}: called with no DTensor inputs")
    mesh = ctx.mesh
    for s in ctx.specs:
        if s.mesh != mesh:
            raise MeshMismatchError(f"{op}: DTensor inputs live on different meshes ({mesh} and {s.mesh}); "
                                "redistribute them onto one mesh first")
    entry = registry.entry(op)
    rule = entry.rule
    if rule is None:
        if not _settings.fallback_to_replicate:
            raise ShardingError(
                f"{op} has no sharding rule (inputs: {_describe(schema)}). Register one with "
                f"@shardprop.register_sharding({op}), or set SHARDPROP_FALLBACK_REPLICATE=1 "
                "(shardprop.set_fallback_to_replicate(True)) to run it on replicated inputs"
                + "".join(hint(op) for hint in no_rule_hints) + ".")
        warnings.warn(f"shardprop: {op} has no sharding rule; replicating its inputs ({_describe(schema)})")
        options = [(tuple(Replicate() for _ in ctx.specs), tuple(Replicate() for _ in ctx.out_metas))]
        per_dim = True
    else:
        options = rule.fn(ctx)
        per_dim = rule.per_dim
        if rule.user:
            options = _user_options(ctx, options, f"{op} rule {rule.name}")
    where = f"{op} rule {rule.name if rule else 'replicate-fallback'}"
    options = [_norm_option(o, len(ctx.specs), where) for o in options]
    if not options:
        raise ShardingError(f"{op}: the rule {where} offers no strategy for inputs {_describe(schema)}")
    if per_dim == "auto":  # user rules: a tuple entry means per-mesh-dim placements
        per_dim = not any(isinstance(p, (tuple, list)) for o in options for side in o for p in side)
    returns = ctx.returns
    self_fixed = returns == "self"
    choose = _choose_per_dim if per_dim else _choose_full
    in_pl, out_pl, candidates = choose(ctx, options, self_fixed)

    in_specs = tuple(s if s.placements == p else s.with_placements(p) for s, p in zip(ctx.specs, in_pl))
    plans = tuple(None if s.placements == p else plan_redistribute(s, p) for s, p in zip(ctx.specs, in_pl))
    metas = ctx.out_metas
    out_specs = []
    for j, meta in enumerate(metas):
        if meta is None:
            out_specs.append(None)
            continue
        if j >= len(out_pl) or out_pl[j] is None or any(p is None for p in out_pl[j]):
            raise ShardingError(f"{where}: gives no placement for output {j}")
        out_specs.append(DTensorSpec(mesh, _normalize_out(out_pl[j], len(meta.shape), where), meta))
    local_call = entry.local_call
    if returns == "out" and check_out:  # the rule checker asks with check_out=False, then makes out= match
        moved = _check_out(schema, out_specs, where)
        if moved is not None:  # out= laid out otherwise: computed as the result, then redistributed into out
            local_call = out_targets.writer(moved[0], moved[1], local_call)
    if (self_fixed and out_specs and out_specs[0] is not None and out_specs[0].placements != ctx.specs[0].placements
            and out_specs[0].placements != in_specs[0].placements):  # equal: a Partial target reduced in place
        raise ShardingError(f"{op}: in-place op would change its target from {list(ctx.specs[0].placements)} "
                            f"to {list(out_specs[0].placements)}")
    if getattr(op, "is_view", False) and returns in ("tensor", "list"):  # the dispatcher wraps views with care (inference mode)
        returns = "view" if returns == "tensor" else "view_list"
    return OutputSharding(tuple(out_specs), in_specs, plans, any(p is not None for p in plans), returns,
                          candidates, local_call)


def _normalize_out(placements, ndim: int, where: str) -> tuple:
    out = []
    for p in placements:
        if type(p) is Shard and p.dim < 0:
            p = Shard(p.dim + ndim)
        if type(p) is Shard and not 0 <= p.dim < ndim:
            raise ShardingError(f"{where}: output placement {p!r} is out of range for a {ndim}-d output")
        out.append(p)
    return tuple(out)


def _check_out(schema: OpSchema, out_specs, where):
    """None if every out= target is laid out as the result; else (names, target specs) to redistribute into.

    A target of another global shape (torch would resize it), or a list of targets, is refused.
    """
    kw = dict(schema.kwargs)
    names = written_kwargs(schema.op)
    given = []
    for name in names:
        v = kw.get(name)
        given.extend(v if type(v) is tuple else (v,))
    differs = False
    for g, s in zip(given, out_specs):
        if type(g) is DTensorSpec and s is not None and g.placements != s.placements:
            if g.shape != s.shape or len(given) != len(names):
                raise ShardingError(f"{schema.op}: the out= DTensor is {list(g.placements)} of shape "
                                    f"{tuple(g.shape)} but the result is {list(s.placements)} of shape "
                                    f"{tuple(s.shape)}; give out= the result's shape")
            differs = True
    if not differs:
        return None
    if not all(type(g) is DTensorSpec for g in given):
        raise ShardingError(f"{schema.op}: out= mixes DTensors and other values; give DTensors laid out as the "
                            f"result")
    return tuple(names), tuple(given)


def propagate(schema: OpSchema) -> OutputSharding:
    """The sharding of ``schema``'s op on its input specs, cached (see :data:`cache`).

    Example:
        >>> propagate(OpSchema(aten.mm.default, (a_spec, b_spec), ()))  # doctest: +SKIP
    """
    e = registry.entry(schema.op)
    key = (schema.args, schema.kwargs)
    out = e.memo.get(key)
    if out is None or out.outside:  # outside the mesh the dispatcher keeps the no-op form: answer afresh
        out = propagate_miss(schema)
        if not runs_outside(out):
            cache.remember(e.memo, key, out)
    return out


def cache_info() -> CacheInfo:
    """The propagation cache's statistics (hits, misses, maxsize, currsize)."""
    entries = list(registry.entries.values())
    calls = sum(e.calls for e in entries)
    misses = sum(e.misses for e in entries)
    return CacheInfo(max(calls - misses, 0), misses, cache.limit, sum(len(e.memo) for e in entries))


def cache_clear() -> None:
    """Empty the propagation cache."""
    cache.clear()


def miss_counts() -> dict:
    """op -> (misses, inserted, seconds spent propagating): the cache-miss counters kept in each op's entry.

    Example:
        >>> miss_counts().get(aten.mm.default, (0, 0, 0.0))  # doctest: +SKIP
        (1, 1, 0.0004)
    """
    return registry.miss_counts()


def reset_miss_counts() -> None:
    """Zero the cache-miss counters (with the cache, by cache_control.clear_cache)."""
    registry.reset_miss_counts()


def add_no_rule_hint(hint: Callable[[object], str]) -> None:
    """Add ``hint(op) -> str`` to the error for ops without a rule (decompose: its opt-in).

    Example:
        >>> add_no_rule_hint(lambda op: "")  # doctest: +SKIP
    """
    no_rule_hints.append(hint)


def set_fallback(enabled: bool) -> None:
    """Whether ops without a rule run replicated (see cache_control.set_fallback_to_replicate)."""
    _config.set("fallback_to_replicate", enabled)
