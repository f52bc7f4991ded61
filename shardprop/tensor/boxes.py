"""Box arithmetic: which box of the global tensor each rank holds, and where boxes overlap.

A *box* is ``(offsets, sizes)`` in global coordinates. It is the one description of a
shard that redistribution and checkpoints share: a point-to-point redistribution within
one mesh (``redistribute.py``) and a cross-mesh move send each target box the overlap of
every source box with it, and the DCP protocol writes and asks for a rank's box
(``__create_write_items__`` / ``__create_chunk_list__``). Boxes follow
:func:`shardprop.tensor.layout.local_shape_and_offset` (``torch.chunk`` order, nested shards
outermost first, uneven and empty pieces included); a ``Partial`` mesh dim splits nothing,
so its box is that of ``Replicate``.
"""
from __future__ import annotations

import functools
import itertools
from typing import List, NamedTuple, Optional, Sequence, Tuple

from shardprop.tensor.layout import local_shape_and_offset
from shardprop.tensor.placement import Partial

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]


def shard_box(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], placements) -> Box:
    """``(offsets, sizes)`` of the shard at mesh coordinate ``coord``.

    Example:
        >>> from shardprop.tensor.placement import Shard
        >>> shard_box((5, 3), (2, 2), (1, 1), (Shard(0), Shard(0)))
        ((4, 0), (1, 3))
    """
    sizes, offsets = local_shape_and_offset(shape, mesh_shape, coord, placements)
    return tuple(offsets), tuple(sizes)


def mesh_ranks(mesh) -> Tuple[Tuple[int, Tuple[int, ...]], ...]:
    """``(global rank, coordinate)`` of every rank of ``mesh``, in row-major mesh order.

    Example:
        >>> mesh_ranks(mesh)  # a 2x2 mesh over ranks 0-3  # doctest: +SKIP
        ((0, (0, 0)), (1, (0, 1)), (2, (1, 0)), (3, (1, 1)))
    """
    coords = itertools.product(*(range(s) for s in mesh.shape))
    return tuple(zip(mesh._flat, coords))


def rank_boxes(shape: Sequence[int], mesh, placements) -> List[Tuple[int, Box]]:
    """``(global rank, box)`` for every rank of ``mesh`` holding a tensor of ``shape`` laid out as ``placements``.

    Example:
        >>> rank_boxes((5,), mesh, [Shard(0)])  # 4 ranks  # doctest: +SKIP
        [(0, ((0,), (2,))), (1, ((2,), (2,))), (2, ((4,), (1,))), (3, ((5,), (0,)))]
    """
    return [(r, shard_box(shape, mesh.shape, c, placements)) for r, c in mesh_ranks(mesh)]


def numel(box: Box) -> int:
    """Number of elements in ``box``."""
    n = 1
    for s in box[1]:
        n *= s
    return n


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The overlap of two boxes, or None when it is empty.

    Example:
        >>> intersect(((0, 0), (4, 4)), ((2, 1), (4, 2)))
        ((2, 1), (2, 2))
        >>> intersect(((0,), (2,)), ((2,), (2,))) is None
        True
    """
    offs, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def relative(box: Box, within: Box) -> Box:
    """``box`` in the coordinates of the shard ``within`` (which contains it).

    Example:
        >>> relative(((2, 1), (2, 2)), ((2, 0), (2, 4)))
        ((0, 1), (2, 2))
    """
    return tuple(o - w for o, w in zip(box[0], within[0])), box[1]


def narrow(t, box: Box):
    """The view of ``t`` (a tensor holding a shard) covering ``box`` given in ``t``'s own coordinates."""
    for d, (o, s) in enumerate(zip(*box)):
        if s != t.shape[d]:
            t = t.narrow(d, o, s)
    return t


class Transfer(NamedTuple):
    """One piece of a move: ``src`` sends ``box`` (global coordinates) to ``dst`` (global ranks)."""

    src: int
    dst: int
    box: Box


@functools.lru_cache(maxsize=1024)
def plan_transfers(shape: Tuple[int, ...], src_mesh, src_placements, dst_mesh, dst_placements) -> Tuple[Transfer, ...]:
    """Every piece each rank must send so that ``dst`` boxes are filled from ``src`` boxes.

    The distinct source boxes partition the tensor; replicas of a box are interchangeable,
    so each target takes a piece from itself when it holds it, otherwise from the replica
    that has sent the fewest elements so far (ties: lowest rank). The plan is a pure function
    of its arguments, so every rank computes the same one without talking. ``Partial``
    sources must be reduced first.

    Example:
        >>> plan_transfers((4,), mesh_01, (Shard(0),), mesh_23, (Replicate(),))  # doctest: +SKIP
        (Transfer(src=0, dst=2, box=((0,), (2,))), Transfer(src=1, dst=2, box=((2,), (2,))), ...)
    """
    if any(type(p) is Partial for p in src_placements):
        raise ValueError(f"plan_transfers: reduce Partial sources {list(src_placements)} before moving them")
    replicas = {}  # box -> ranks holding it, in mesh order
    for r, box in rank_boxes(shape, src_mesh, src_placements):
        if numel(box):
            replicas.setdefault(box, []).append(r)
    sent = {}
    out = []
    for dst, dbox in rank_boxes(shape, dst_mesh, dst_placements):
        if not numel(dbox):
            continue
        for sbox, holders in replicas.items():
            piece = intersect(sbox, dbox)
            if piece is None:
                continue
            src = dst if dst in holders else min(holders, key=lambda r: (sent.get(r, 0), r))
            if src != dst:
                sent[src] = sent.get(src, 0) + numel(piece)
            out.append(Transfer(src, dst, piece))
    return tuple(out)
