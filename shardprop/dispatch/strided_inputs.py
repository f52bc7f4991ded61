"""What propagation does with ``_StridedShard`` inputs, which no rule knows: pure helpers for ``propagate``.

A strided input reaches a rule gathered on its strided mesh dims (:func:`unstrided`), except for a
pointwise op whose inputs share one layout: that runs on the aligned local pieces as they are.

Example:
    >>> is_pointwise(torch.ops.aten.mul_.Tensor), is_pointwise(torch.ops.aten.mm.default)
    (True, False)
"""
from __future__ import annotations

import torch

from shardprop.tensor.placement import Replicate, Shard, _StridedShard, has_strided
from shardprop.tensor.spec import DTensorSpec


def unstrided(a, as_shard: bool = False):
    """``a`` (a schema's args or kwargs) with every ``_StridedShard`` of every spec as ``Replicate`` (or as
    the ``Shard`` of its dim).

    Example:
        >>> unstrided((spec_with_strided, 2.0))  # doctest: +SKIP
    """
    if type(a) is DTensorSpec:
        if not has_strided(a.placements):
            return a
        return a.with_placements((Shard(p.dim) if as_shard else Replicate()) if type(p) is _StridedShard else p
                                 for p in a.placements)
    if type(a) is tuple:
        return tuple(unstrided(x, as_shard) for x in a)
    return a


# Elementwise in effect but without torch's ``pointwise`` tag: an output element is made from the inputs'
# elements at its own index (or from none). Random ``*_like`` ops are not: their values depend on the layout.
_ELEMENTWISE_UNTAGGED = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "_to_copy", "copy",
                                   "copy_", "fill", "fill_", "zero", "zero_", "detach", "alias"})


def is_pointwise(op) -> bool:
    """Each output element depends on the inputs' elements at its index only (torch's ``pointwise`` tag)."""
    return torch.Tag.pointwise in op.tags or op.overloadpacket.__name__ in _ELEMENTWISE_UNTAGGED
