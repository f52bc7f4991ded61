"""Reductions (sum, mean, amax, argmax, var, ...): one rule driven by a table of kinds.

A reduction keeps every shard of a dim it does not reduce (renumbered when
``keepdim=False``). A reduced dim that is sharded leaves each rank with the
reduction of its own chunk, which is right only when the op combines over
ranks the way a Partial does:

* sum / nansum / count_nonzero: the local sums add up -> ``P(sum)`` (an empty
  chunk sums to 0, so uneven shards are fine);
* mean: the local means average to the global mean only when every chunk has
  the same size -> ``P(avg)``, offered only when the dim splits evenly;
* amax / amin / max / min (full): ``P(max)`` / ``P(min)``, offered only when no
  chunk is empty (a max over nothing raises);
* any / all: ``P(max)`` / ``P(min)`` of booleans (empty chunks give the identity);
* prod: the local products multiply -> ``P(product)`` (an empty chunk's product is 1);
* arg-reductions, var, std, logsumexp, norms: no Partial combines them ->
  the reduced dim must be replicated.

Partial inputs pass through when the op commutes with the Partial's reduction:
sum and mean are linear (``P(sum)``, ``P(avg)``); amax keeps ``P(max)``, amin ``P(min)``, prod
``P(product)``.
"""
from __future__ import annotations

import functools
import itertools
from typing import NamedTuple, Optional, Tuple

import torch

from shardprop.dispatch.dispatcher import _TRUE
from shardprop.dispatch.registry import rule
from shardprop.mesh.compat import aten_ops
from shardprop.tensor.layout import chunk_bounds
from shardprop.tensor.placement import Partial, Replicate, Shard

aten = torch.ops.aten


class Reduction(NamedTuple):
    """How one op family reduces.

    ``partial``: per output, the Partial a sharded reduced dim turns into (None:
    the reduced dims must be replicated); ``pieces``: what every chunk of such a
    dim must be ("any", "nonempty", "even"); ``passthrough``: Partial reduce ops
    an input may carry to the output unchanged; ``empty_dims``: what an empty dim
    list means ("all" dims, or "none" as for any.dims / all.dims).
    """

    partial: Optional[Tuple[str, ...]]
    pieces: str = "any"
    passthrough: Tuple[str, ...] = ()
    empty_dims: str = "all"


SUM = Reduction(("sum",), "any", ("sum", "avg"))
MEAN = Reduction(("avg",), "even", ("sum", "avg"))
MAX = Reduction(("max",), "nonempty", ("max",))
MIN = Reduction(("min",), "nonempty", ("min",))
COUNT = Reduction(("sum",))
ANY = Reduction(("max",), empty_dims="none")
ALL = Reduction(("min",), empty_dims="none")
MINMAX = Reduction(("min", "max"), "nonempty")
PROD = Reduction(("product",), "any", ("product",))
REPLICATE = Reduction(None)

# (packet name, overloads or None for every eligible one, kind)
TABLE = [
    ("sum", ("default", "dim_IntList", "IntList_out"), SUM),
    ("nansum", None, SUM),
    ("count_nonzero", None, COUNT),
    ("mean", None, MEAN),
    ("amax", None, MAX),
    ("amin", None, MIN),
    ("max", ("default", "unary_out"), MAX),
    ("min", ("default", "unary_out"), MIN),
    ("any", ("default", "dim", "dims", "out", "dims_out", "all_out"), ANY),
    ("all", ("default", "dim", "dims", "out", "dims_out", "all_out"), ALL),
    ("aminmax", None, MINMAX),
    ("prod", None, PROD),
    # No Partial combines these: a reduced dim must be whole on every rank.
    ("max", ("dim",), REPLICATE),
    ("min", ("dim",), REPLICATE),
    ("argmax", None, REPLICATE),
    ("argmin", None, REPLICATE),
    ("var", None, REPLICATE),
    ("std", None, REPLICATE),
    ("var_mean", None, REPLICATE),
    ("std_mean", None, REPLICATE),
    ("logsumexp", None, REPLICATE),
    ("linalg_vector_norm", None, REPLICATE),
]


def _eligible(op) -> bool:
    """Tensor-in overloads whose only written argument (if any) is ``out=``: the engine handles those."""
    s = op._schema
    if not s.arguments or s.arguments[0].type.kind() != "TensorType":
        return False
    return all(a.alias_info is None or not a.alias_info.is_write or a.name == "out" for a in s.arguments)


def _resolve(table) -> dict:
    kinds = {}
    for name, overloads, kind in table:
        for op in aten_ops([name], overloads):
            if _eligible(op):
                kinds[op] = kind
    return kinds


KINDS = _resolve(TABLE)


@functools.lru_cache(maxsize=None)
def _arg_slots(op) -> dict:
    """name -> (positional index or None, has default, default) for the op's schema arguments."""
    slots = {}
    for i, a in enumerate(op._schema.arguments):
        slots[a.name] = (None if a.kwarg_only else i, a.has_default_value(), a.default_value)
    return slots


_MISSING = object()


def _arg(ctx, name):
    slot = _arg_slots(ctx.op).get(name)
    if slot is None:
        return _MISSING
    pos, has_default, default = slot
    if pos is not None and pos < len(ctx.args):
        return ctx.args[pos]
    if name in ctx.kwargs:
        return ctx.kwargs[name]
    return default if has_default else _MISSING


def reduced_dims(ctx, kind: Reduction, ndim: int):
    """(sorted reduced dims, keepdim) from the call, or None if they disagree with the output shape.

    Example:
        >>> reduced_dims(ctx_of_sum_over_minus_1, SUM, 3)  # doctest: +SKIP
        ((2,), False)
    """
    dim = _arg(ctx, "dim")
    keep = _arg(ctx, "keepdim")
    keepdim = keep is _TRUE or keep is True
    if dim is _MISSING or dim is None:
        dims = tuple(range(ndim))
    else:
        given = dim if isinstance(dim, (tuple, list)) else (dim,)
        if not given:
            dims = tuple(range(ndim)) if kind.empty_dims == "all" else ()
        elif ndim == 0:
            dims = ()
        else:
            dims = tuple(sorted({d % ndim for d in given}))
    # Trust the interpretation only if it predicts the output shape (meta kernels are the reference).
    shape = ctx.specs[0].shape
    want = [1 if d in dims else s for d, s in enumerate(shape)] if keepdim else \
        [s for d, s in enumerate(shape) if d not in dims]
    for meta in ctx.out_metas:
        if meta is not None and list(meta.shape) != want:
            return None
    return dims, keepdim


def pieces_ok(size, mesh_shape: tuple, need: str) -> bool:
    """Cached :func:`_pieces_ok`; symbolic sizes (torch.compile, dynamic shapes) are not hashable: uncached."""
    if type(size) is int:
        return _pieces_ok_cached(size, mesh_shape, need)
    return _pieces_ok(size, mesh_shape, need)


def _pieces_ok(size, mesh_shape: tuple, need: str) -> bool:
    """Whether ``size`` cut along any subset of mesh dims (outermost first) gives pieces meeting ``need``.

    The rule cannot know which mesh dims will end up sharding the dim (each is
    chosen separately), so it asks for every combination.

    Example:
        >>> pieces_ok(6, (2, 2), "even"), pieces_ok(8, (2, 2), "even"), pieces_ok(5, (4,), "nonempty")
        (False, True, False)
    """
    if need == "any":
        return True
    for r in range(1, len(mesh_shape) + 1):
        for subset in itertools.combinations(mesh_shape, r):
            pieces = [size]
            for k in subset:
                pieces = [chunk_bounds(p, k, i)[1] for p in pieces for i in range(k)]
            if need == "even" and any(p != pieces[0] for p in pieces):  # no set(): sizes may be symbolic
                return False
            if need == "nonempty" and min(pieces) == 0:
                return False
    return True


_pieces_ok_cached = functools.lru_cache(maxsize=None)(_pieces_ok)


def reduction_options(ctx, kind: Reduction) -> list:
    """Per-mesh-dim options for a reduction of the first argument."""
    spec = ctx.specs[0]
    n_out = len(ctx.out_metas)
    replicate = ((Replicate(),), (Replicate(),) * n_out)
    parsed = reduced_dims(ctx, kind, spec.ndim)
    if parsed is None:
        return [replicate]
    dims, keepdim = parsed
    options = []
    for d in range(spec.ndim):
        if d not in dims:
            out_d = d if keepdim else d - sum(1 for r in dims if r < d)
            options.append(((Shard(d),), (Shard(out_d),) * n_out))
        elif kind.partial is not None and pieces_ok(spec.shape[d], tuple(ctx.mesh.shape), kind.pieces):
            options.append(((Shard(d),), tuple(Partial(p) for p in kind.partial)))
    for op in kind.passthrough:
        options.append(((Partial(op),), (Partial(op),) * n_out))
    options.append(replicate)
    return options


@rule(*KINDS)
def reduction(ctx):
    return reduction_options(ctx, KINDS[ctx.op])
