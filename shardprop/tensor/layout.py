"""Where a rank's shard sits in the global tensor (``torch.chunk`` order, nested over mesh dims).

Uneven sizes are normal: with ``c = ceil(n / k)`` piece ``i`` covers
``[min(i*c, n), min((i+1)*c, n))``, so leading ranks hold full pieces and trailing
ranks may hold empty ones. When several mesh dims shard one tensor dim, each
later mesh dim splits the piece the earlier ones left (outermost first).
"""
from __future__ import annotations

from typing import Sequence, Tuple

from shardprop.tensor.placement import Shard, _StridedShard
from shardprop.tensor.strided import strided_len, strided_shape_and_offset


def chunk_bounds(size: int, parts: int, index: int) -> Tuple[int, int]:
    """(offset, length) of piece ``index`` when ``size`` is chunked into ``parts``.

    Example:
        >>> [chunk_bounds(5, 4, i) for i in range(4)]
        [(0, 2), (2, 2), (4, 1), (5, 0)]
    """
    c = -(-size // parts)
    start = min(index * c, size)
    return start, min(start + c, size) - start


def chunk_size(size: int, parts: int) -> int:
    """The largest piece when ``size`` is chunked into ``parts`` (what padding pads to)."""
    return -(-size // parts)


def local_shape_and_offset(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                           placements) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """This coordinate's local shard shape and its offset in the global tensor.

    With a ``_StridedShard`` the shard is several runs of the dim: the offset is its first
    global index, as torch reports it (``strided.dim_indices`` gives them all).

    Example:
        >>> local_shape_and_offset((5, 3), (2, 2), (1, 1), (Shard(0), Shard(0)))
        ((1, 3), (4, 0))
    """
    size = list(shape)
    offset = [0] * len(shape)
    for m, p in enumerate(placements):
        if type(p) is Shard:
            off, length = chunk_bounds(size[p.dim], mesh_shape[m], coord[m])
            offset[p.dim] += off
            size[p.dim] = length
        elif type(p) is _StridedShard:  # several runs: the index-list arithmetic, from the start
            return strided_shape_and_offset(shape, mesh_shape, coord, placements)
    return tuple(size), tuple(offset)


def is_even(shape: Sequence[int], mesh_shape: Sequence[int], placements) -> bool:
    """True when every shard has the same shape on every rank."""
    size = list(shape)
    for m, p in enumerate(placements):
        if type(p) is Shard:
            if size[p.dim] % mesh_shape[m]:
                return False
            size[p.dim] //= mesh_shape[m]
        elif type(p) is _StridedShard:
            lens = {strided_len(size[p.dim], mesh_shape[m], p.split_factor, r) for r in range(mesh_shape[m])}
            if len(lens) != 1:
                return False
            size[p.dim] = lens.pop()
    return True
