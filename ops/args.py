"""Reading an op's arguments by schema name inside a rule (positional, keyword or default).

Rules see ``ctx.args``/``ctx.kwargs`` as the call gave them; these helpers let a rule ask
for ``"dim"`` or give placements for ``"self"`` and ``"index"`` without counting positions.
"""
from __future__ import annotations

import functools

from shardprop.tensor.placement import Replicate
from shardprop.tensor.spec import DTensorSpec

R = Replicate()
_MISSING = object()


@functools.lru_cache(maxsize=None)
def _slot(op, name: str):
    """(positional index or None if keyword-only, default or _MISSING) of argument ``name``."""
    for i, a in enumerate(op._schema.arguments):
        if a.name == name:
            return (None if a.kwarg_only else i), (a.default_value if a.has_default_value() else _MISSING)
    return None, _MISSING


@functools.lru_cache(maxsize=None)
def _names(op) -> tuple:
    return tuple(a.name for a in op._schema.arguments)


def arg(ctx, name: str, default=None):
    """The call's value of schema argument ``name`` (positional or keyword), else its schema default.

    Example:
        >>> arg(ctx_of_sort_stable, "dim")  # sort(x, stable=True) -> the schema default  # doctest: +SKIP
        -1
    """
    pos, schema_default = _slot(ctx.op, name)
    if pos is not None and pos < len(ctx.args):
        return ctx.args[pos]
    if name in ctx.kwargs:
        return ctx.kwargs[name]
    return schema_default if schema_default is not _MISSING else default


def inputs_by_name(ctx, **by_name) -> tuple:
    """One placement per DTensor input (``ctx.specs`` order), chosen by schema argument name.

    A tensor-list argument gives its placement to all its tensors; arguments not named are
    Replicate.

    Example:
        >>> inputs_by_name(ctx, self=Shard(1), index=Shard(1))  # gather: (S(1), S(1))  # doctest: +SKIP
    """
    out = []

    def visit(name, value):
        if type(value) is DTensorSpec:
            out.append(by_name.get(name, R))
        elif type(value) is tuple:
            for v in value:
                visit(name, v)

    for name, value in zip(_names(ctx.op), ctx.args):
        visit(name, value)
    for name, value in ctx.kwargs.items():
        visit(name, value)
    return tuple(out)
