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

_BUILTIN: Dict[object, "Rule"] = {}
# op -> local_call(op, output_sharding, local_args, local_kwargs): how to run the op on the
# shards when the plain call with the global arguments is wrong (sizes given globally, a
# masked lookup on a vocab shard). Chosen once per schema, at propagation.
LOCAL_CALLS: Dict[object, Callable] = {}
_USER: Dict[object, "Rule"] = {}
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


def lookup(op) -> Optional[Rule]:
    """The rule in force for ``op``: a user's if registered, else the built-in one."""
    r = _USER.get(op)
    return r if r is not None else _BUILTIN.get(op)


def has_builtin(op) -> bool:
    """Whether shardprop ships a rule for ``op``."""
    return op in _BUILTIN


def register_sharding(op, *, per_dim: Optional[bool] = None):
    """Register a user sharding rule for ``op``, overriding any built-in rule.

    The decorated function receives the op's arguments with every DTensor
    replaced by its ``DTensorSpec`` and returns a list of acceptable options,
    each ``(input_placements, output_placements)``: one entry per DTensor input
    and per output. An entry is a Placement (used on every mesh dim) or a
    tuple of Placements (one per mesh dim). shardprop picks the option that
    needs the least communication.

    Example:
        >>> @shardprop.register_sharding(torch.ops.mylib.scale.default)  # doctest: +SKIP
        ... def scale_rule(x, factor):
        ...     return [([Shard(0)], [Shard(0)]), ([Replicate()], [Replicate()])]
    """
    def deco(fn):
        def user_rule(ctx):
            return fn(*ctx.args, **ctx.kwargs)
        user_rule.__qualname__ = getattr(fn, "__qualname__", "user_rule")
        user_rule.user_fn = fn
        for o in _overloads(op):
            _USER[o] = Rule(user_rule, per_dim if per_dim is not None else "auto", user=True)
        _changed()
        return fn
    return deco


def unregister_sharding(op) -> None:
    """Remove a user rule; the built-in rule (if any) is used again.

    Example:
        >>> unregister_sharding(torch.ops.aten.relu.default)  # doctest: +SKIP
    """
    for o in _overloads(op):
        _USER.pop(o, None)
    _changed()


def _changed() -> None:
    for fn in _listeners:
        fn()
