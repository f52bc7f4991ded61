"""Ops that work along one dim (or a few): scans, sorts, selections, flips, rolls.

Each output element depends on a whole line of the input along the op's dim(s), and
only on that line. So any *other* dim may stay sharded (every rank holds whole lines),
while the op's own dims must be replicated: a cumsum, sort or flip of a chunk is not
the chunk of the cumsum, sort or flip.

One table (``TABLE``) says, per op, which argument names the dim(s) and how the output
dims follow the input's (``Along``); one rule turns that into options. Partials pass
through where the op commutes with their reduction: cumsum is linear (``P(sum)``,
``P(avg)``); flip and roll only move elements, so every Partial passes.

``renorm`` is the opposite case: it rescales each slice ``x.select(dim, i)`` by that
slice's norm, so the named dim may be sharded and every other dim must be whole.

Example:
    >>> x = distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)])  # doctest: +SKIP
    >>> torch.cumsum(x, dim=1).placements   # rows are whole: no communication  # doctest: +SKIP
    (Shard(dim=0),)
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import torch

from shardprop.dispatch.dispatcher import _TRUE
from shardprop.dispatch.registry import rule
from shardprop.mesh.compat import aten_ops
from shardprop.tensor.placement import Partial, Replicate, Shard

from .args import arg

aten = torch.ops.aten
R = Replicate()
LINEAR = ("sum", "avg")
MOVES = ("sum", "avg", "max", "min")


class Along(NamedTuple):
    """How an op uses its dim argument.

    ``arg``: the schema argument naming the dim(s); ``out``: "same" (output dims are the
    input's), "reduce" (the dim is dropped unless ``keepdim``) or "only" (the named dim is
    the only one that may be sharded); ``partials``: Partial reduce ops that pass through;
    ``empty``: what an empty dim list means ("all": flatten first, as roll does).
    """

    arg: str
    out: str = "same"
    partials: Tuple[str, ...] = ()
    empty: str = "none"


SCAN_LINEAR = Along("dim", partials=LINEAR)
ALONG = Along("dim")
SELECT = Along("dim", out="reduce")
FLIP = Along("dims", partials=MOVES)
ROLL = Along("dims", partials=MOVES, empty="all")
ONLY = Along("dim", out="only")

# (packet, overloads or None for all, kind)
TABLE = [
    ("cumsum", None, SCAN_LINEAR),
    ("cumprod", None, ALONG),
    ("logcumsumexp", None, ALONG),
    ("cummax", None, ALONG),
    ("cummin", None, ALONG),
    ("cummaxmin_backward", None, ALONG),
    ("sort", ("default", "stable", "values", "values_stable"), ALONG),
    ("topk", None, ALONG),
    ("_safe_softmax", None, ALONG),
    ("glu", None, ALONG),
    ("glu_backward", None, ALONG),
    ("kthvalue", ("default", "values"), SELECT),
    ("median", ("dim", "dim_values"), SELECT),
    ("nanmedian", ("dim", "dim_values"), SELECT),
    ("mode", None, SELECT),
    ("flip", None, FLIP),
    ("roll", None, ROLL),
    ("renorm", None, ONLY),
]


def _resolve(table) -> dict:
    kinds = {}
    for name, overloads, kind in table:
        for op in aten_ops([name], overloads):
            kinds[op] = kind
    return kinds


KINDS = _resolve(TABLE)
def normalize_dims(value, ndim: int, empty: str = "none") -> tuple:
    """The dims named by ``value`` (int, list or None) as sorted non-negative ints.

    ``None`` or (for ``empty="all"``) an empty list means every dim; a 0-d tensor has none.

    Example:
        >>> normalize_dims(-1, 3), normalize_dims((0, -1), 3), normalize_dims((), 2, "all")
        ((2,), (0, 2), (0, 1))
    """
    if ndim == 0:
        return ()
    if value is None:
        return tuple(range(ndim))
    given = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not given and empty == "all":
        return tuple(range(ndim))
    return tuple(sorted({d % ndim for d in given}))


def along_options(ctx, kind: Along) -> list:
    """Per-mesh-dim options: shard any dim the op does not work along (or only it, for "only")."""
    specs = ctx.specs
    ndim = specs[0].ndim
    dims = normalize_dims(arg(ctx, kind.arg, None), ndim, kind.empty)
    keepdim = arg(ctx, "keepdim", False) in (_TRUE, True)
    outs = ctx.out_metas
    options = []
    for d in range(ndim):
        if (d in dims) != (kind.out == "only"):
            continue
        if any(s.ndim != ndim or s.shape[d] != specs[0].shape[d] for s in specs[1:]):
            continue  # inputs of other ranks (none of this table's ops have them) are never sharded
        out_d = d if kind.out != "reduce" or keepdim else d - sum(1 for r in dims if r < d)
        options.append(((Shard(d),) * len(specs), tuple(None if m is None else Shard(out_d) for m in outs)))
    options.append(((R,) * len(specs), tuple(None if m is None else R for m in outs)))
    if all(m is None or m.dtype.is_floating_point or m.dtype.is_complex for m in outs):
        for p in kind.partials:  # only float results: a cast to int does not commute with a sum
            options.append(((Partial(p),) * len(specs), tuple(None if m is None else Partial(p) for m in outs)))
    return options


@rule(*KINDS)
def along_dim(ctx):
    return along_options(ctx, KINDS[ctx.op])
