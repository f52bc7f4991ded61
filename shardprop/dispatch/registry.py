"""Where sharding rules live: built-in ones from ``shardprop.ops`` and users' overrides.

A rule is a function of a :class:`PropContext` returning acceptable options:

* per-mesh-dim rules (the default) return ``[(input_placements, output_placements), ...]``
  with one single Placement per DTensor input and per output; the engine picks
  the cheapest option for each mesh dim independently (cost linear in mesh ndim);
* full rules (``per_dim=False``) return options whose entries are tuples of
  placements, one per mesh dim (view ops need this: nested shards depend on the
  mesh dims before them).

A user rule always wins over a built-in one for the same op.

Everything the engine knows about one op overload is gathered in its :class:`OpEntry`, built at
the op's first use (``entry(op)``): the rule in force, the local call, the special handler, the
positionwise flag, what the op writes into, the method that runs it on plain tensors, its memo
and its call counter. The dispatcher's hot path reads that one object. The registration
functions below record what was declared and update (or drop, to be rebuilt) the entries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional

import torch

from shardprop.dispatch import hooks as _hooks_mod
from shardprop.dispatch.method_calls import local_callable
from shardprop.dispatch.op_schema import _Marker

# What was declared, per op (the entries are built from these; only registration reads them).
_BUILTIN: Dict[object, "Rule"] = {}
# op -> local_call(op, output_sharding, local_args, local_kwargs): how to run the op on the
# shards when the plain call with the global arguments is wrong (sizes given globally, a
# masked lookup on a vocab shard). Chosen once per schema, at propagation.
LOCAL_CALLS: Dict[object, Callable] = {}
_USER: Dict[object, "Rule"] = {}
# op -> fn(*meta_args, **meta_kwargs): the op's outputs on meta tensors, for ops whose own meta
# kernel is stricter than their device kernels (_grouped_mm's meta accepts bf16 only, its CPU
# kernel float32 too). Used by propagation to infer output shapes.
OUTPUT_METAS: Dict[object, Callable] = {}
_listeners = []  # called when rules change (the propagation cache clears itself)
# op -> handler(op, args, kwargs) for ops that need more than a rule (register_special).
_SPECIAL: Dict[object, Callable] = {}
# Special ops whose handler may run on a rank outside the mesh as is: it communicates nothing
# itself (a local read, or a decomposition whose ops come back through the dispatcher).
_OUTSIDE_SAFE = set()
# Ops over lists whose position i depends only on position i of each list (_foreach_*, the fused
# optimizers): lists mixing plain tensors and DTensors, or DTensors of several meshes, run as one
# call per group (the dispatcher's _split_positions). Filled by the rooms that own their rules.
_POSITIONWISE = set()
# View ops whose result torch itself documents as "a view or a copy": writing into it is
# not expected to reach the base, so it needs no guard when its input had to move.
_MAY_COPY = {torch.ops.aten.reshape.default, torch.ops.aten.reshape_as.default}
_hooks = _hooks_mod.hooks

# op -> its OpEntry (read by the dispatcher's hot path: ``entries.get(op)``).
entries: Dict[object, "OpEntry"] = {}


class _Unasked:
    """``OpEntry.special`` until the op's first dispatch has asked the first-call hook."""

    __slots__ = ()

    def __repr__(self):
        return "<special handler not decided yet>"


UNASKED = _Unasked()


class OpEntry:
    """What the engine knows about one op overload (one object: the hot path reads its attributes).

    - ``rule``: the :class:`Rule` in force (a user's over the built-in one), or None;
    - ``local_call``: ``fn(op, out, largs, lkwargs)`` that runs it on the shards, or None (see
      :func:`register_local_call`); ``output_meta``: its output-meta override, or None;
    - ``special``: its special handler, None, or :data:`UNASKED` until its first dispatch;
      ``outside_safe``: that handler may run on a rank outside the mesh as is;
    - ``positionwise``: a list op split by position when lists mix meshes or plain tensors;
    - ``written``: names of the keyword-only arguments it writes into; ``alias``: 'self', 'out' or None;
    - ``guard_view``: a view op whose result, when its input had to move, is a guarded copy;
    - ``call``: the fastest callable that runs it on plain tensors (``method_calls``);
    - ``hash``: ``hash(op)`` once; ``memo``: (arg keys, kwarg keys) -> OutputSharding;
    - counters: ``calls`` (dispatcher calls), ``misses`` (propagations), ``inserted`` (those that
      succeeded: entries put in the cache), ``miss_seconds`` (time spent propagating).

    Example:
        >>> e = entry(torch.ops.aten.add_.Tensor); e.alias, e.call is torch.Tensor.add_
        ('self', True)
    """

    __slots__ = ("op", "hash", "special", "outside_safe", "calls", "call", "memo", "rule", "local_call",
                 "output_meta", "positionwise", "written", "alias", "guard_view", "misses", "inserted", "miss_seconds")

    def __init__(self, op):
        self.op = op
        self.hash = hash(op)
        self.special = _SPECIAL.get(op, UNASKED)
        self.outside_safe = op in _OUTSIDE_SAFE
        self.calls = 0
        self.call = local_callable(op)
        self.memo = {}
        self.rule = lookup(op)
        self.local_call = LOCAL_CALLS.get(op)
        self.output_meta = OUTPUT_METAS.get(op)
        self.positionwise = op in _POSITIONWISE
        self.written = written_kwargs(op)
        self.alias = op_alias(op)
        self.guard_view = bool(getattr(op, "is_view", False)) and op not in _MAY_COPY
        self.misses = self.inserted = 0
        self.miss_seconds = 0.0

    def __repr__(self):
        return f"OpEntry({self.op})"


def entry(op) -> OpEntry:
    """``op``'s entry, built at its first use.

    Example:
        >>> entry(torch.ops.aten.mm.default).rule is not None  # doctest: +SKIP
        True
    """
    e = entries.get(op)
    if e is None:
        e = entries[op] = OpEntry(op)
    return e


def settle_special(e: OpEntry):
    """At ``e``'s first dispatch: its special handler, asking the first-call hook when none is registered.

    The hook (decompose's) may register a handler for the op meanwhile: the entry then reads it.
    """
    handler = _SPECIAL.get(e.op)
    if handler is None and _hooks.first_call_hook is not None:
        handler = _hooks.first_call_hook(e.op)
    e.special = handler
    e.outside_safe = e.op in _OUTSIDE_SAFE
    return handler


def _special_changed(op) -> None:
    """A special handler registered or removed: the entry starts its dispatch life afresh (handler,
    call counter, memo); with none registered its next dispatch asks the first-call hook again."""
    e = entries.get(op)
    if e is not None:
        e.special = _SPECIAL.get(op, UNASKED)
        e.outside_safe = op in _OUTSIDE_SAFE
        e.calls = 0
        e.memo.clear()


def _refresh(o) -> None:
    e = entries.get(o)
    if e is not None:
        e.rule = lookup(o)
        e.local_call = LOCAL_CALLS.get(o)
        e.output_meta = OUTPUT_METAS.get(o)


def op_alias(op):
    """('self' | 'out' | None) from the op's schema: does it write into its first argument, or out=?"""
    try:
        s = op._schema
    except AttributeError:
        return None
    if s.arguments and s.arguments[0].alias_info is not None and s.arguments[0].alias_info.is_write:
        return "self"
    if any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in s.arguments):
        return "out"
    return None


def written_kwargs(op) -> tuple:
    """Names of the keyword-only arguments ``op`` writes into (``out``, ``values``/``indices``, ...)."""
    try:
        return tuple(a.name for a in op._schema.arguments
                     if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)
    except AttributeError:
        return ()


def special_handler(op):
    """The special handler registered for ``op``, or None.

    Example:
        >>> special_handler(aten.mm.default) is None  # doctest: +SKIP
        True
    """
    return _SPECIAL.get(op)


def register_special(op, handler, *, outside_safe: bool = False) -> None:
    """Route ``op`` to ``handler(op, args, kwargs)`` instead of the rule-based path.

    ``outside_safe``: the handler communicates nothing itself, so it runs as is on a rank
    outside the mesh (else such a rank takes ``outside``'s no-op path, see the dispatcher's ``_special_outside``).

    Example:
        >>> register_special(aten._local_scalar_dense.default, item_handler)  # doctest: +SKIP
    """
    _SPECIAL[op] = handler
    if outside_safe:
        _OUTSIDE_SAFE.add(op)
    else:
        _OUTSIDE_SAFE.discard(op)
    _special_changed(op)


def unregister_special(op) -> None:
    """Send ``op`` back to the rule-based path (undoes :func:`register_special`).

    Example:
        >>> unregister_special(aten._local_scalar_dense.default)  # doctest: +SKIP
    """
    _SPECIAL.pop(op, None)
    _OUTSIDE_SAFE.discard(op)
    _special_changed(op)


def register_positionwise(ops) -> None:
    """Mark list ops whose position i depends only on position i of each list (see ``_POSITIONWISE``).

    Example:
        >>> register_positionwise([aten._foreach_add.List])  # doctest: +SKIP
    """
    for op in ops:
        _POSITIONWISE.add(op)
        e = entries.get(op)
        if e is not None:
            e.positionwise = True


def ops_seen_without_special() -> list:
    """Ops dispatched before whose entry holds no special handler (decompose re-checks them)."""
    return [op for op, e in list(entries.items()) if e.special is None]


def call_counts() -> dict:
    """op -> number of dispatcher calls (for statistics)."""
    return {op: e.calls for op, e in entries.items() if e.calls}


def reset_counts() -> None:
    """Zero the dispatcher call counters."""
    for e in entries.values():
        e.calls = 0


def miss_counts() -> dict:
    """op -> (misses, inserted, seconds spent propagating), for ops propagated since the last reset."""
    return {op: (e.misses, e.inserted, e.miss_seconds) for op, e in entries.items() if e.misses}


def reset_miss_counts() -> None:
    """Zero the propagation (cache-miss) counters."""
    for e in entries.values():
        e.misses = e.inserted = 0
        e.miss_seconds = 0.0


def clear_memos() -> None:
    """Forget every op's remembered propagation answers (with the propagation cache)."""
    for e in entries.values():
        e.memo.clear()


@dataclass(frozen=True)
class Rule:
    """A registered sharding rule."""

    fn: Callable
    per_dim: bool
    user: bool = False
    strided: bool = False  # the rule takes _StridedShard inputs as they are (else they reach it gathered)

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


def _overloads(op) -> Iterable:
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def rule(*ops, per_dim: bool = True, strided: bool = False):
    """Register a built-in rule for ``ops`` (overloads, or packets meaning all their overloads).

    ``strided=True``: the rule places ``_StridedShard`` inputs itself (list ops that update each
    position from the same position of the other lists); other rules see them gathered.

    Example:
        >>> @rule(aten.relu.default, aten.neg.default)  # doctest: +SKIP
        ... def unary(ctx): return [((Replicate(),), (Replicate(),))]
    """
    def deco(fn):
        for op in ops:
            for o in _overloads(op):
                _BUILTIN[o] = Rule(fn, per_dim, strided=strided)
                _refresh(o)
        _changed()
        return fn
    return deco


def register_local_call(op, fn: Callable) -> None:
    """Run ``op`` on the shards with ``fn(op, out, largs, lkwargs)`` instead of ``op(*largs, **lkwargs)``.

    ``out`` is the OutputSharding (its ``in_specs``/``out_specs`` say what this rank holds).

    Example:
        >>> register_local_call(aten.view.default, view_with_local_sizes)  # doctest: +SKIP
    """
    for o in _overloads(op):
        LOCAL_CALLS[o] = fn
        _refresh(o)
    _changed()


def register_output_meta(op, fn: Callable) -> None:
    """Infer ``op``'s output shapes with ``fn`` on meta tensors instead of the op's own meta kernel.

    Example:
        >>> register_output_meta(aten._grouped_mm.default, grouped_mm_meta)  # doctest: +SKIP
    """
    for o in _overloads(op):
        OUTPUT_METAS[o] = fn
        _refresh(o)
    _changed()


def lookup(op) -> Optional[Rule]:
    """The rule in force for ``op``: a user's if registered, else the built-in one."""
    r = _USER.get(op)
    return r if r is not None else _BUILTIN.get(op)


def has_builtin(op) -> bool:
    """Whether shardprop ships a rule for ``op``."""
    return op in _BUILTIN


def register_sharding(op, *, per_dim: Optional[bool] = None):
    """Register a user sharding rule for ``op`` (an overload, a packet, or a list of them).

    The decorated function is called as the op is: every argument given, positional
    and keyword (``out=`` tensors included), with each DTensor replaced by its
    ``DTensorSpec`` and other arguments as their values (a Python float is the
    ``<float>`` marker: floats share cache entries). It returns a list of acceptable
    options, each ``(input_placements, output_placements)``, with one output entry
    per output (None for a non-tensor one) and the inputs given either

    * one entry per DTensor input, in argument order; or
    * one entry per argument as given (positional, then keyword), None for each
      non-tensor argument, as torch's ``register_sharding`` takes them (entries
      for ``out=`` tensors may be given; the engine places those as the outputs).

    An entry is a Placement (used on every mesh dim) or a tuple of Placements (one
    per mesh dim). shardprop picks the option that needs the least communication.
    ``shardprop.experimental.register_sharding`` takes torch's (outputs, inputs) order.

    Example:
        >>> @shardprop.register_sharding(torch.ops.mylib.scale.default)  # doctest: +SKIP
        ... def scale_rule(x, factor):
        ...     return [([Shard(0), None], [Shard(0)]), ([Replicate(), None], [Replicate()])]
    """
    ops = op if isinstance(op, (list, tuple)) else [op]

    def deco(fn):
        def user_rule(ctx):
            # The rule sees what the caller passed: out= tensors too, and bools as bools
            # (the cache key holds markers for them, which are all truthy).
            args = tuple(_user_value(a) for a in ctx.args)
            kwargs = {k: _user_value(v) for k, v in ctx.schema.kwargs}
            return fn(*args, **kwargs)
        user_rule.__qualname__ = getattr(fn, "__qualname__", "user_rule")
        user_rule.user_fn = fn
        for one in ops:
            for o in _overloads(one):
                _USER[o] = Rule(user_rule, per_dim if per_dim is not None else "auto", user=True)
                _refresh(o)
        _changed()
        return fn
    return deco


def _user_value(a):
    """An argument in key form as a user rule sees it: bool markers become bools again."""
    if type(a) is tuple:
        return tuple(_user_value(x) for x in a)
    if type(a) is _Marker and a.name in _BOOLS:
        return _BOOLS[a.name]
    return a


_BOOLS = {"<True>": True, "<False>": False}


def unregister_sharding(op) -> None:
    """Remove a user rule (``op``: as for register_sharding); the built-in rule (if any) is used again.

    Example:
        >>> unregister_sharding(torch.ops.aten.relu.default)  # doctest: +SKIP
    """
    for one in (op if isinstance(op, (list, tuple)) else [op]):
        for o in _overloads(one):
            _USER.pop(o, None)
            _refresh(o)
    _changed()


def add_listener(fn) -> None:
    """Call ``fn()`` whenever rules are registered or removed (the propagation cache clears itself).

    Example:
        >>> add_listener(lambda: None)  # doctest: +SKIP
    """
    _listeners.append(fn)


def _changed() -> None:
    for fn in _listeners:
        fn()
