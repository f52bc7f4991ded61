"""Grouped matmul (``torch._grouped_mm``): one product per group, the groups cut by ``offs``.

MoE experts: tokens sorted by expert ``[tokens, k]`` times stacked expert weights
``[experts, k, n]``. Each layout of the operands is an einsum equation with the labels that
``offs`` cuts (a token dim sorted into groups, the groups' own dim) pinned: ``offs`` holds
global offsets, so a shard of a pinned dim would pair each rank's rows with the wrong groups.
``offs`` is itself always replicated. Every other label is free:

* a label of the output sharded in every operand holding it shards the output;
* a contracted label sharded in both factors gives ``P(sum)``; a ``P(sum)``/``P(avg)`` factor
  times a replicated one stays so (each group's product is linear in each factor);
* all-Replicate always works.

A ``bias`` (per group, ``[groups, n]``) follows ``n`` and forbids Partial outputs.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from shardprop.dispatch.registry import register_output_meta, rule
from shardprop.tensor.placement import Partial, Replicate, Shard
from shardprop.tensor.spec import DTensorSpec

aten = torch.ops.aten


class GroupedLayout(NamedTuple):
    """Dim labels of ``a``, ``b``, the output and a bias, and the labels ``offs`` pins."""

    a: str
    b: str
    out: str
    bias: str
    pinned: str


# (a.ndim, b.ndim) -> layout. g: groups, t/m: rows, k: contracted, n: columns.
LAYOUTS = {
    (2, 3): GroupedLayout("tk", "gkn", "tn", "gn", "tg"),   # tokens sorted by group x stacked experts
    (3, 3): GroupedLayout("gmk", "gkn", "gmn", "gn", ""),   # batched, no offs
    (2, 2): GroupedLayout("mk", "kn", "gmn", "gn", "kg"),   # k cut into groups (a weight gradient)
    (3, 2): GroupedLayout("gmk", "kn", "mn", "gn", "ng"),   # n cut into groups
}

LINEAR_REDUCE_OPS = ("sum", "avg")


def _operands(args, kwargs):
    """(a, b, offs, bias) of a call, by position or keyword."""
    names = ("self", "mat2", "offs", "bias")
    vals = list(args[:4]) + [None] * (4 - len(args[:4]))
    for i, n in enumerate(names):
        if n in kwargs:
            vals[i] = kwargs[n]
    return vals


def grouped_mm_options(args, kwargs) -> list:
    """Per-mesh-dim options for ``_grouped_mm``, aligned with the DTensor operands (a, b, offs, bias).

    Example:
        >>> grouped_mm_options((a, b, offs), {})[0]  # doctest: +SKIP
        ((R, S(2), R), (S(1),))
    """
    a, b, offs, bias = _operands(args, kwargs)
    if type(a) is not DTensorSpec or type(b) is not DTensorSpec:
        raise TypeError("_grouped_mm rule: both matrices must be DTensors (wrap the other with "
                        "DTensor.from_local(..., [Replicate()]) or use implicit_replication())")
    lay = LAYOUTS.get((a.ndim, b.ndim))
    if lay is None:
        raise ValueError(f"_grouped_mm rule: no layout for a {a.ndim}-d by {b.ndim}-d product")
    # The operands that are DTensors, in argument order, with their labels (None: replicated always).
    slots = [(a, lay.a), (b, lay.b)] + [(t, lab) for t, lab in ((offs, None), (bias, lay.bias))
                                        if type(t) is DTensorSpec]
    has_bias = type(bias) is DTensorSpec

    def shard(label):
        return tuple(Shard(lab.index(label)) if lab and label in lab else Replicate() for _, lab in slots)

    free = [label for label in dict.fromkeys(lay.a + lay.b) if label not in lay.pinned]
    options = [(shard(label), (Shard(lay.out.index(label)),)) for label in free if label in lay.out]
    if not has_bias:
        for label in free:
            if label not in lay.out:  # contracted: each rank's product is a part of the sum
                options.append((shard(label), (Partial("sum"),)))
        for op in LINEAR_REDUCE_OPS:
            for f in range(2):
                ins = [Replicate()] * len(slots)
                ins[f] = Partial(op)
                options.append((tuple(ins), (Partial(op),)))
    options.append(((Replicate(),) * len(slots), (Replicate(),)))
    return options


def grouped_mm_meta(a, b, offs=None, bias=None, out_dtype=None):
    """The output of ``_grouped_mm`` on meta tensors, any floating dtype.

    torch's meta kernel accepts bf16 only (CUDA's restriction); its CPU kernel takes float32 too.

    Example:
        >>> m = lambda *s: torch.empty(*s, device="meta")
        >>> grouped_mm_meta(m(32, 16), m(4, 16, 8), m(4)).shape
        torch.Size([32, 8])
    """
    lay = LAYOUTS.get((a.ndim, b.ndim))
    if lay is None:
        raise ValueError(f"_grouped_mm: no layout for a {a.ndim}-d by {b.ndim}-d product")
    size = dict(zip(lay.a, a.shape))
    size.update(zip(lay.b, b.shape))
    if "g" not in size:  # 2-d by 2-d: one output per group of offs
        size["g"] = offs.shape[0]
    return torch.empty([size[label] for label in lay.out], dtype=out_dtype or a.dtype, device="meta")


_OPS = [p for p in (getattr(aten, "_grouped_mm", None),) if p is not None]

if _OPS:
    @rule(*_OPS)
    def grouped_mm(ctx):
        return grouped_mm_options(ctx.args, ctx.kwargs)

    register_output_meta(_OPS[0], grouped_mm_meta)
