"""out= targets laid out differently from the op's result: compute, then redistribute into out (as torch does).

The strategy picks the result's layout from the inputs (``torch.add(x_S0, 3, out=y_R)`` gives
``S(0)``); the out= DTensor keeps its own. ``writer`` makes the local call for such an op: the
local op writes into fresh buffers laid out as the result, each is moved to its target's
placements (the planner's prepared program) and copied into the target's local tensor. The
targets' global shapes must equal the result's (propagation checks); nothing is resized.

Example:
    >>> torch.add(x_s0, 3, out=y_r)  # y_r stays Replicate and holds x + 3  # doctest: +SKIP
"""
from __future__ import annotations

import functools

from shardprop.tensor.redistribute import redistribute_local


def writer(names: tuple, target_specs: tuple, inner):
    """The local call for an out= op whose targets (``names``, laid out as ``target_specs``) differ from the result.

    ``inner`` is the op's own local call (None: the op itself).

    Example:
        >>> writer(("out",), (spec_r,), None)  # doctest: +SKIP
    """
    return functools.partial(_write, names, target_specs, inner)


def _write(names, target_specs, inner, op, out, largs, lkwargs):
    fresh = dict(lkwargs)
    for n in names:
        fresh[n] = lkwargs[n].new_empty(0)  # an out= op resizes an empty buffer without a warning
    if inner is None:
        op(*largs, **fresh)
    else:
        inner(op, out, largs, fresh)
    for n, spec, target in zip(names, out.out_specs, target_specs):
        local = fresh[n]
        if spec.placements != target.placements:
            local = redistribute_local(local, spec, target.placements)
        lkwargs[n].copy_(local)
    return None


__all__ = ["writer"]
