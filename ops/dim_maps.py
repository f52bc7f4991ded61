"""Dim maps: how each output dim of a view-like op derives from the input dims.

Pure data and arithmetic (no torch, no mesh): the view rules in ``ops/view.py``
build a map for an op call and ask :func:`map_placements` which shards survive.

A dim map is a tuple with one entry per output dim:

* ``Same(d)``: input dim ``d`` unchanged (permute, squeeze, a slice that keeps all);
* ``Flatten(dims)``: consecutive input dims merged, outermost first;
* ``Split(source, sizes, index)``: piece ``index`` of ``source`` (a ``Same`` or a
  ``Flatten``) cut into ``sizes`` (view ``(48,) -> (6, 8)``, ``(4, 6) -> (3, 8)``);
* ``Singleton()``: a new size-1 dim (unsqueeze);
* ``Broadcast(d, size)``: size-1 input dim ``d`` (None: no input dim) expanded to ``size``;
* ``Resized(d)``: input dim ``d`` with another extent (slice, split piece, padding back);
* ``Fresh(size)``: an output dim no input dim feeds (the dims of an empty reshape).

A shard of input dim ``d`` survives only through the entry that *carries* ``d``:
``Same(d)``, a ``Flatten`` whose outermost dim is ``d``, or piece 0 of a ``Split``
of such a source. Each rank's rows of ``d`` become a contiguous range of the output
dim; the shard survives on a mesh dim iff those ranges are exactly ``torch.chunk``'s
pieces of the output dim, for every parent piece the earlier mesh dims leave.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

from shardprop.tensor.placement import Replicate, Shard


@dataclass(frozen=True)
class Same:
    """Output dim is input dim ``dim`` unchanged."""

    dim: int


@dataclass(frozen=True)
class Flatten:
    """Output dim merges consecutive input ``dims`` (outermost first)."""

    dims: Tuple[int, ...]


@dataclass(frozen=True)
class Split:
    """Output dim is piece ``index`` of ``source`` cut into ``sizes`` (outermost first)."""

    source: Union[Same, Flatten]
    sizes: Tuple[int, ...]
    index: int


@dataclass(frozen=True)
class Singleton:
    """A new output dim of size 1."""


@dataclass(frozen=True)
class Broadcast:
    """Input dim ``dim`` of size 1 (or None: a new dim) expanded to ``size``."""

    dim: Optional[int]
    size: int


@dataclass(frozen=True)
class Resized:
    """Input dim ``dim`` with another extent (slice, split piece, padded back): carries no shard."""

    dim: int


@dataclass(frozen=True)
class Fresh:
    """An output dim of ``size`` fed by no single input dim: carries no shard."""

    size: int


DimMap = Tuple[object, ...]


# ------------------------------------------------------------------ builders
def identity_map(ndim: int) -> DimMap:
    """Every dim unchanged.

    Example:
        >>> identity_map(2)
        (Same(dim=0), Same(dim=1))
    """
    return tuple(Same(d) for d in range(ndim))


def permute_map(ndim: int, perm: Sequence[int]) -> DimMap:
    """Output dim ``i`` is input dim ``perm[i]`` (negative dims allowed).

    Example:
        >>> permute_map(3, (2, 0, 1))
        (Same(dim=2), Same(dim=0), Same(dim=1))
    """
    return tuple(Same(p % ndim if ndim else 0) for p in perm)


def transpose_map(ndim: int, d0: int, d1: int) -> DimMap:
    """Dims ``d0`` and ``d1`` swapped (a 0-d or 1-d tensor is unchanged).

    Example:
        >>> transpose_map(3, 0, -1)
        (Same(dim=2), Same(dim=1), Same(dim=0))
    """
    if ndim == 0:
        return ()
    perm = list(range(ndim))
    d0, d1 = d0 % ndim, d1 % ndim
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return permute_map(ndim, perm)


def movedim_perm(ndim: int, source: Sequence[int], destination: Sequence[int]) -> Tuple[int, ...]:
    """The permutation ``movedim(source, destination)`` applies.

    Example:
        >>> movedim_perm(4, (0,), (2,))
        (1, 2, 0, 3)
    """
    src = [s % ndim for s in source]
    dst = [d % ndim for d in destination]
    perm = [None] * ndim
    for s, d in zip(src, dst):
        perm[d] = s
    rest = iter(d for d in range(ndim) if d not in src)
    return tuple(p if p is not None else next(rest) for p in perm)


def squeeze_map(shape: Sequence[int], dims: Optional[Sequence[int]] = None) -> DimMap:
    """Drop the size-1 dims among ``dims`` (all dims when None); others kept.

    Example:
        >>> squeeze_map((4, 1, 6), (1,))
        (Same(dim=0), Same(dim=2))
    """
    n = len(shape)
    drop = set(range(n)) if dims is None else {d % n for d in dims} if n else set()
    return tuple(Same(d) for d in range(n) if not (d in drop and shape[d] == 1))


def unsqueeze_map(ndim: int, dim: int) -> DimMap:
    """A new size-1 dim at ``dim`` (counted in the output's ``ndim + 1`` dims).

    Example:
        >>> unsqueeze_map(2, -1)
        (Same(dim=0), Same(dim=1), Singleton())
    """
    dim = dim % (ndim + 1)
    ins = [Same(d) for d in range(ndim)]
    return tuple(ins[:dim] + [Singleton()] + ins[dim:])


def expand_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> DimMap:
    """Broadcast ``in_shape`` to ``out_shape`` (aligned from the right).

    Example:
        >>> expand_map((4, 1), (2, 4, 6))
        (Broadcast(dim=None, size=2), Same(dim=0), Broadcast(dim=1, size=6))
    """
    lead = len(out_shape) - len(in_shape)
    out = []
    for o, size in enumerate(out_shape):
        d = o - lead
        if d < 0:
            out.append(Broadcast(None, size))
        elif in_shape[d] == size:
            out.append(Same(d))
        else:
            out.append(Broadcast(d, size))
    return tuple(out)


def view_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> DimMap:
    """The map of a reshape: groups of input and output dims with equal products.

    Size-1 dims on one side only are dropped (input) or new singletons (output);
    a group of several input dims is a Flatten, of several output dims a Split.
    A reshape of an empty tensor keeps nothing unless the shape is unchanged.

    Example:
        >>> view_map((4, 6), (3, 8))[0]
        Split(source=Flatten(dims=(0, 1)), sizes=(3, 8), index=0)
        >>> view_map((8, 6), (48,))
        (Flatten(dims=(0, 1)),)
    """
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    if in_shape == out_shape:
        return identity_map(len(in_shape))
    if 0 in in_shape or 0 in out_shape:  # products say nothing about an empty tensor
        return tuple(Fresh(s) for s in out_shape)
    out = []
    i = j = 0
    nin, nout = len(in_shape), len(out_shape)
    while i < nin or j < nout:
        a = in_shape[i] if i < nin else None
        b = out_shape[j] if j < nout else None
        if a == 1 and b == 1:
            out.append(Same(i))
            i, j = i + 1, j + 1
        elif b == 1:
            out.append(Singleton())
            j += 1
        elif a == 1:
            i += 1  # a size-1 input dim that no output dim keeps
        else:
            gi, gj = [i], [j]
            pin, pout = a, b
            i, j = i + 1, j + 1
            while pin != pout:
                if pin < pout:
                    pin *= in_shape[i]
                    gi.append(i)
                    i += 1
                else:
                    pout *= out_shape[j]
                    gj.append(j)
                    j += 1
            source = Same(gi[0]) if len(gi) == 1 else Flatten(tuple(gi))
            if len(gj) == 1:
                out.append(source)
            else:
                sizes = tuple(out_shape[k] for k in gj)
                out.extend(Split(source, sizes, k) for k in range(len(gj)))
    return tuple(out)


def cut_map(in_shape: Sequence[int], out_shape: Sequence[int], dim: int, keepdim: bool = True) -> DimMap:
    """A piece along ``dim`` (slice, narrow, split): ``dim`` is Resized unless whole; dropped if not keepdim.

    Example:
        >>> cut_map((4, 6), (4, 2), 1)
        (Same(dim=0), Resized(dim=1))
        >>> cut_map((4, 6), (6,), 0, keepdim=False)
        (Same(dim=1),)
    """
    n = len(in_shape)
    dim = dim % n
    out = []
    for d in range(n):
        if d != dim:
            out.append(Same(d))
        elif keepdim:
            out.append(Same(d) if out_shape[d] == in_shape[d] else Resized(d))
    return tuple(out)


def embed_map(grad_shape: Sequence[int], out_shape: Sequence[int], dim: int, keepdim: bool = True) -> DimMap:
    """The inverse of a cut: ``grad`` placed back into a tensor of ``out_shape`` along ``dim``.

    ``keepdim=False`` is select_backward (``dim`` is re-inserted), True slice_backward.

    Example:
        >>> embed_map((4,), (4, 6), 1, keepdim=False)
        (Same(dim=0), Fresh(size=6))
    """
    n = len(out_shape)
    dim = dim % n
    out = []
    for o in range(n):
        if o < dim:
            out.append(Same(o))
        elif o == dim:
            if not keepdim:
                out.append(Fresh(out_shape[o]))
            else:
                out.append(Same(o) if grad_shape[o] == out_shape[o] else Resized(o))
        else:
            out.append(Same(o if keepdim else o - 1))
    return tuple(out)


# ------------------------------------------------------------------ sharding
def _carried(entry, in_shape) -> Optional[Tuple[int, int, int]]:
    """(input dim, scale in, scale out) when ``entry`` carries a shard, else None.

    One row of the input dim is ``scale_in`` units and one row of the output dim
    ``scale_out`` units, a unit being one element of the flattened group.
    """
    t = type(entry)
    if t is Same:
        return entry.dim, 1, 1
    if t is Flatten:
        return entry.dims[0], math.prod(in_shape[d] for d in entry.dims[1:]), 1
    if t is Split and entry.index == 0:
        src = _carried(entry.source, in_shape)
        return src[0], src[1], math.prod(entry.sizes[1:])
    return None


def _bounds(size: int, parts: int) -> Tuple[int, ...]:
    """Start of every torch.chunk piece of ``size`` over ``parts``, then the end."""
    c = -(-size // parts)
    return tuple(min(i * c, size) for i in range(parts)) + (size,)


def _pieces(size: int, parts: int) -> tuple:
    """The distinct piece lengths of ``size`` chunked over ``parts``."""
    b = _bounds(size, parts)
    return _distinct(b[i + 1] - b[i] for i in range(parts))


def _distinct(sizes) -> tuple:
    """``sizes`` without repeats; symbolic sizes (torch.compile, dynamic shapes) do not hash: kept all."""
    sizes = tuple(sizes)
    try:
        return tuple(set(sizes))
    except TypeError:
        return sizes


def chunks_agree(rows: int, scale_in: int, scale_out: int, parts: int) -> bool:
    """Whether chunking ``rows`` (each ``scale_in`` units) over ``parts`` gives the same
    unit ranges as chunking the same units in rows of ``scale_out``.

    Example:
        >>> chunks_agree(8, 6, 1, 4)   # (8, 6) -> (48,): rows of 2 are 12 elements each
        True
        >>> chunks_agree(5, 3, 1, 4)   # (5, 3) -> (15,): rows [2,2,1,0] vs chunk(15, 4)
        False
    """
    units = rows * scale_in
    if units % scale_out:
        return False
    b_in = _bounds(rows, parts)
    b_out = _bounds(units // scale_out, parts)
    return all(x * scale_in == y * scale_out for x, y in zip(b_in, b_out))


def map_placements(maps: Sequence[DimMap], in_shape: Sequence[int], mesh_shape: Sequence[int],
                   placements: Sequence[object]) -> Tuple[tuple, Tuple[tuple, ...]]:
    """Input placements the op needs and each output's placements, keeping every shard it can.

    ``maps`` has one dim map per output (split-like ops have several). A mesh dim's
    shard is kept iff every output carries its tensor dim and the chunks agree for
    every parent piece the earlier kept mesh dims leave; otherwise that mesh dim is
    replicated. Replicate and Partial pass through (every view is linear).

    Example:
        >>> # (6, 3) -> (18,): 3 rows per rank are 9 elements = chunk(18, 2), but the
        >>> # inner mesh dim splits 3 rows into 2 + 1 (6 + 3 elements), not chunk(9, 2) = 5 + 4
        >>> map_placements([view_map((6, 3), (18,))], (6, 3), (2, 2), (Shard(0), Shard(0)))
        ((S(0), R), ((S(0), R),))
    """
    carriers = []
    for m in maps:
        c = {}
        for o, entry in enumerate(m):
            got = _carried(entry, in_shape)
            if got is not None:
                c[got[0]] = (o, got[1], got[2])
        carriers.append(c)
    parents = {}  # input dim -> possible parent piece lengths under the kept mesh dims
    ins, outs = [], [[] for _ in maps]
    for m, p in enumerate(placements):
        if type(p) is not Shard:
            ins.append(p)
            for o in outs:
                o.append(p)
            continue
        d, k = p.dim, mesh_shape[m]
        rows = parents.get(d, (in_shape[d],))
        ok = all(d in c and all(chunks_agree(n, c[d][1], c[d][2], k) for n in rows) for c in carriers)
        if ok:
            parents[d] = _distinct(s for n in rows for s in _pieces(n, k))
            ins.append(p)
            for o, c in zip(outs, carriers):
                o.append(Shard(c[d][0]))
        else:
            ins.append(Replicate())
            for o in outs:
                o.append(Replicate())
    return tuple(ins), tuple(tuple(o) for o in outs)
