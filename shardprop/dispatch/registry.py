"""Where sharding rules live: built-in ones from ``shardprop.ops`` and users' overrides.

A rule is a function of a :class:`PropContext` returning acceptable options:

* per-mesh-dim rules (the default) return ``[(input_placements, output_placements), ...]``
  with one single Placement per DTensor input and per output; the engine picks
  the cheapest option for each mesh dim independently (cost linear in mesh ndim);
* full rules (``per_dim=False``) return options whose entries are tuples of
  placements, one per mesh dim (view ops need this: nested shards depend on the
  mesh dims before them).

A user rule always wins over a built-in one for the same op.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional

import torch

from shardprop.dispatch.op_schema import _Marker

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


@dataclass(frozen=True)
class Rule:
    """A registered sharding rule."""

    fn: Callable
    per_dim: bool
    user: bool = False

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


def _overloads(op) -> Iterable:
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def rule(*ops, per_dim: bool = True):
    """Register a built-in rule for ``ops`` (overloads, or packets meaning all their overloads).

    Example:
        >>> @rule(aten.relu.default, aten.neg.default)  # doctest: +SKIP
        ... def unary(ctx): return [((Replicate(),), (Replicate(),))]
    """
    def deco(fn):
        for op in ops:
            for o in _overloads(op):
                _BUILTIN[o] = Rule(fn, per_dim)
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
    _changed()


def register_output_meta(op, fn: Callable) -> None:
    """Infer ``op``'s output shapes with ``fn`` on meta tensors instead of the op's own meta kernel.

    Example:
        >>> register_output_meta(aten._grouped_mm.default, grouped_mm_meta)  # doctest: +SKIP
    """
    for o in _overloads(op):
        OUTPUT_METAS[o] = fn
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
