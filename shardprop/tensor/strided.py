"""``_StridedShard`` layout: which global indices a rank holds (its steps: ``strided_steps.py``).

A strided shard of a dim of length ``n`` on ``k`` ranks with split factor ``sf``: the dim is
chunked into ``sf`` pieces (``torch.chunk`` order), each piece into ``k`` parts, and rank ``r``
holds part ``r`` of every piece, concatenated (torch's ``_StridedShard``). Its positions in the
parent are several runs, so a rank's shard is described by an index list, never one box.

Nested over mesh dims as every shard is: a later mesh dim splits what the earlier ones left,
so a tensor dim's global indices on a rank are the parent's indices picked at the positions
each mesh dim keeps (:func:`dim_indices`).

Example:
    >>> strided_positions(9, 4, 2, 0), strided_positions(9, 4, 2, 3)
    ([0, 1, 5], [8])
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from shardprop.tensor.placement import Shard, _StridedShard


def _bounds(size: int, parts: int, index: int):
    c = -(-size // parts)
    start = min(index * c, size)
    return start, min(start + c, size) - start


def strided_positions(n: int, k: int, split_factor: int, r: int) -> List[int]:
    """Positions (in a parent of length ``n``) that rank ``r`` of ``k`` holds under ``_StridedShard(sf)``.

    Example:
        >>> strided_positions(8, 2, 2, 1)
        [2, 3, 6, 7]
    """
    out: List[int] = []
    for j in range(split_factor):
        off, ln = _bounds(n, split_factor, j)
        o, l = _bounds(ln, k, r)
        out.extend(range(off + o, off + o + l))
    return out


def strided_len(n: int, k: int, split_factor: int, r: int) -> int:
    """How many of a parent's ``n`` positions rank ``r`` of ``k`` holds (no list built).

    Example:
        >>> [strided_len(9, 4, 2, r) for r in range(4)]
        [3, 3, 2, 1]
    """
    return sum(_bounds(_bounds(n, split_factor, j)[1], k, r)[1] for j in range(split_factor))


def dim_indices(size: int, mesh_shape: Sequence[int], coord: Sequence[int], placements, dim: int) -> List[int]:
    """Global indices of tensor dim ``dim`` (length ``size``) held at mesh coordinate ``coord``, in local order.

    Example:
        >>> dim_indices(8, (2, 2), (1, 0), (_StridedShard(0, split_factor=2), Shard(0)), 0)
        [2, 3]
    """
    idx = list(range(size))
    for m, p in enumerate(placements):
        if getattr(p, "dim", None) != dim:
            continue
        k, r = mesh_shape[m], coord[m]
        if type(p) is Shard:
            off, ln = _bounds(len(idx), k, r)
            idx = idx[off:off + ln]
        elif type(p) is _StridedShard:
            idx = [idx[i] for i in strided_positions(len(idx), k, p.split_factor, r)]
    return idx


def strided_shape_and_offset(shape, mesh_shape, coord, placements):
    """Local shape and first global index per dim (torch's offset for a strided shard: its first element).

    Example:
        >>> strided_shape_and_offset((8, 3), (2,), (1,), (_StridedShard(0, split_factor=2),))
        ((4, 3), (2, 0))
    """
    size, offset = list(shape), [0] * len(shape)
    for d in {p.dim for p in placements if type(p) in (Shard, _StridedShard)}:
        idx = dim_indices(shape[d], mesh_shape, coord, placements, d)
        size[d] = len(idx)
        # An empty shard sits at the end of the dim, as torch places it.
        offset[d] = idx[0] if idx else shape[d]
    return tuple(size), tuple(offset)


def strided_box(shape, mesh_shape, coord, placements):
    """(offsets, sizes) of this coordinate's shard when it is one box of the global tensor, else None.

    A strided shard is usually several runs; nested under a ``Shard`` of the same dim whose pieces it
    splits (fully_shard over expert-parallel experts: ``[_StridedShard(0, sf=ep), Shard(0)]``) each
    rank's indices are one run, and checkpoints can describe it as a box.

    Example:
        >>> strided_box((8, 3), (2, 2), (1, 0), (_StridedShard(0, split_factor=2), Shard(0)))
        ((2, 0), (2, 3))
        >>> strided_box((8, 3), (2,), (1,), (_StridedShard(0, split_factor=2),)) is None
        True
    """
    offsets, sizes = [0] * len(shape), list(shape)
    for d in {p.dim for p in placements if type(p) in (Shard, _StridedShard)}:
        idx = dim_indices(shape[d], mesh_shape, coord, placements, d)
        if idx and idx != list(range(idx[0], idx[0] + len(idx))):
            return None
        offsets[d], sizes[d] = (idx[0], len(idx)) if idx else (shape[d], 0)
    return tuple(offsets), tuple(sizes)


def pick(full: torch.Tensor, mesh_shape, coord, placements) -> torch.Tensor:
    """This coordinate's shard of ``full`` (a new contiguous tensor), strided placements included.

    Example:
        >>> pick(torch.arange(8), (2,), (1,), (_StridedShard(0, split_factor=2),)).tolist()
        [2, 3, 6, 7]
    """
    out = full
    for d in sorted({p.dim for p in placements if type(p) in (Shard, _StridedShard)}):
        idx = dim_indices(full.shape[d], mesh_shape, coord, placements, d)
        out = out.index_select(d, torch.tensor(idx, dtype=torch.long, device=full.device))
    return out.contiguous()
