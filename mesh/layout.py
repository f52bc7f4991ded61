"""MeshLayout: where each dim of a mesh sits in its universe of ranks (torch's ``DeviceMesh._layout``).

Every mesh lives in a *universe*: a 1-d tensor of world ranks (its ``_rank_map``). A root mesh's
universe is its ranks in ascending order, so every mesh over the same ranks shares one universe,
however it was built (``init_device_mesh``, a hand-written rank list, ``_unflatten``), and slices of
different roots combine (:func:`shardprop.mesh.reshape.concatenate`). A mesh dim is a set of
(size, stride) pairs over positions in the universe, outer pair first: ``(2, 4), (2, 1)`` walks
positions 0, 1, 4, 5 (a flattened pair of dims that were not adjacent). A mesh's ranks are
``rank_map[offset + sum(coord_d * stride_d)]`` for one offset per copy of the mesh (its *cosets*:
``mesh["tp"]`` on a (2, 2) root has two, one per dp coordinate).

This module is arithmetic only: no process group, no mesh object.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

Pair = Tuple[int, int]  # (size, stride)
Axis = Tuple[Pair, ...]


def _normalize(pairs: Sequence[Pair]) -> Axis:
    """``pairs`` without size-1 entries, neighbours merged where the outer one continues the inner one."""
    out = []
    for size, stride in pairs:
        size, stride = int(size), int(stride)
        if size == 1:
            continue  # a size-1 pair adds no rank: equal layouts must compare equal
        if out and out[-1][1] == size * stride:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return tuple(out)


class MeshLayout:
    """An immutable, hashable layout of a mesh's dims in its universe: one tuple of (size, stride) pairs per dim.

    ``sizes`` is each dim's size (``shape`` of the mesh); ``strides`` each dim's stride in the universe
    (0 for a size-1 dim, a tuple for a dim flattened from dims that were not adjacent).

    Example:
        >>> lay = MeshLayout.from_sizes_strides((2, 2, 2))
        >>> lay.sizes, lay.strides
        ((2, 2, 2), (4, 2, 1))
        >>> lay.select((0, 2)).collapse().strides
        ((4, 1),)
    """

    __slots__ = ("axes", "_hash")

    def __init__(self, axes: Sequence[Sequence[Pair]]):
        object.__setattr__(self, "axes", tuple(_normalize(a) for a in axes))
        object.__setattr__(self, "_hash", hash(self.axes))

    def __setattr__(self, name, value):
        raise AttributeError("MeshLayout is immutable")

    def __reduce__(self):
        return (MeshLayout, (self.axes,))

    @classmethod
    def from_sizes_strides(cls, sizes: Sequence[int], strides: Optional[Sequence[int]] = None) -> "MeshLayout":
        """One single-pair dim per size; row-major strides unless given.

        Example:
            >>> MeshLayout.from_sizes_strides((2, 3)).strides
            (3, 1)
        """
        sizes = tuple(int(s) for s in sizes)
        if strides is None:
            strides = tuple(math.prod(sizes[i + 1:]) for i in range(len(sizes)))
        if len(strides) != len(sizes):
            raise ValueError(f"MeshLayout: {len(sizes)} sizes {sizes} but {len(strides)} strides {tuple(strides)}")
        return cls([((s, d),) for s, d in zip(sizes, strides)])

    # ---- what torch's _MeshLayout answers ---------------------------------------
    @property
    def sizes(self) -> Tuple[int, ...]:
        return tuple(math.prod(s for s, _ in a) for a in self.axes)

    top_level_sizes = sizes

    @property
    def strides(self) -> tuple:
        return tuple(0 if not a else a[0][1] if len(a) == 1 else tuple(d for _, d in a) for a in self.axes)

    def __len__(self) -> int:
        return len(self.axes)

    def numel(self) -> int:
        return math.prod(self.sizes)

    def cosize(self) -> int:
        """One past the largest position the layout reaches from offset 0."""
        return 1 + sum((s - 1) * d for a in self.axes for s, d in a)

    def __eq__(self, other) -> bool:
        return isinstance(other, MeshLayout) and self.axes == other.axes

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        def axis(a):
            if not a:
                return "1:0"
            if len(a) == 1:
                return f"{a[0][0]}:{a[0][1]}"
            return f"({','.join(str(s) for s, _ in a)}):({','.join(str(d) for _, d in a)})"
        return f"MeshLayout({', '.join(axis(a) for a in self.axes)})"

    # ---- building new layouts ---------------------------------------------------
    def select(self, dims: Sequence[int]) -> "MeshLayout":
        """The layout of the dims ``dims``, in that order (a slice ``mesh[names]``)."""
        return MeshLayout([self.axes[d] for d in dims])

    def collapse(self) -> "MeshLayout":
        """All dims as one, outer dim first (``_flatten``).

        Example:
            >>> MeshLayout.from_sizes_strides((2, 2)).collapse().sizes
            (4,)
        """
        return MeshLayout([tuple(p for a in self.axes for p in a)])

    @staticmethod
    def concat(layouts: Sequence["MeshLayout"]) -> "MeshLayout":
        """The dims of every layout, in order (``_concatenate``)."""
        return MeshLayout([a for lay in layouts for a in lay.axes])

    def split(self, dim: int, sizes: Sequence[int]) -> "MeshLayout":
        """Dim ``dim`` split row-major into dims of ``sizes`` (``_unflatten``).

        Example:
            >>> MeshLayout.from_sizes_strides((8,)).split(0, (2, 4)).strides
            (4, 1)
        """
        sizes = tuple(int(s) for s in sizes)
        axis = list(self.axes[dim])
        have = math.prod(s for s, _ in axis)
        if math.prod(sizes) != have:
            raise ValueError(f"_unflatten: the sizes {sizes} multiply to {math.prod(sizes)}, but mesh dim {dim} "
                             f"has size {have}")
        new = []
        for want in reversed(sizes):  # innermost new dim takes the innermost pairs
            got = []
            while want > 1:
                size, stride = axis.pop()
                if size % want == 0:
                    got.append((want, stride))
                    if size > want:
                        axis.append((size // want, stride * want))
                    want = 1
                elif want % size == 0:
                    got.append((size, stride))
                    want //= size
                else:
                    raise ValueError(f"_unflatten: cannot split mesh dim {dim} {self.axes[dim]} into sizes {sizes}: "
                                     f"{want} and {size} do not divide one another")
            new.append(tuple(reversed(got)))
        axes = list(self.axes)
        axes[dim:dim + 1] = list(reversed(new))
        return MeshLayout(axes)

    # ---- checks and positions ---------------------------------------------------
    def _pairs_by_stride(self):
        return sorted((d, s) for a in self.axes for s, d in a)

    def orthogonal(self) -> bool:
        """Whether no two coordinates reach one position (the dims do not overlap)."""
        reach = 1
        for d, s in self._pairs_by_stride():
            if d % reach:
                return False
            reach = d * s
        return True

    def complement(self, n: int) -> Optional[Axis]:
        """The (size, stride) pairs, outer first, that tile a universe of ``n`` with copies of this layout;
        None when copies cannot tile it (overlap, or strides that do not divide)."""
        gaps, reach = [], 1
        for d, s in self._pairs_by_stride():
            if d % reach:
                return None
            if d > reach:
                gaps.append((d // reach, reach))
            reach = d * s
        if n % reach:
            return None
        if n > reach:
            gaps.append((n // reach, reach))
        return tuple(reversed(gaps))

    def positions(self, n: int) -> torch.Tensor:
        """Positions of every copy of the layout in a universe of ``n``: shape ``(copies, *sizes)``, copies in
        ascending order of their first position.

        Example:
            >>> MeshLayout.from_sizes_strides((2,), (2,)).positions(4).tolist()
            [[0, 2], [1, 3]]
        """
        comp = self.complement(n)
        if comp is None:
            raise ValueError(f"{self} does not tile a universe of {n} ranks")
        pairs = list(comp) + [p for a in self.axes for p in a]
        full = torch.arange(n, dtype=torch.int64).as_strided([s for s, _ in pairs], [d for _, d in pairs])
        return full.reshape(-1, *self.sizes)


def place(mesh: torch.Tensor, rank_map: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, MeshLayout]:
    """(universe, layout) of a mesh tensor: in ``rank_map`` when given and the mesh fits it as a layout
    with non-negative strides; else in its own ranks sorted; else (ranks that no strides describe) in
    its own ranks in row-major order.

    Example:
        >>> u, lay = place(torch.tensor([[0, 2], [1, 3]]))
        >>> u.tolist(), lay.strides
        ([0, 1, 2, 3], (1, 2))
    """
    if rank_map is not None:
        lay = _fit(mesh, rank_map)
        if lay is not None:
            return rank_map, lay
    ranks = mesh.flatten().sort().values
    lay = _fit(mesh, ranks)
    if lay is not None:
        return ranks, lay
    return mesh.flatten().clone(), MeshLayout.from_sizes_strides(tuple(mesh.shape))


def _fit(mesh: torch.Tensor, rank_map: torch.Tensor) -> Optional[MeshLayout]:
    """The layout whose one copy is ``mesh`` in ``rank_map``, or None."""
    if mesh.numel() == 0 or rank_map.numel() == 0:
        return None
    top = int(max(int(rank_map.max()), int(mesh.max()))) + 1
    where = torch.full((top,), -1, dtype=torch.int64)
    where[rank_map] = torch.arange(rank_map.numel(), dtype=torch.int64)
    pos = where[mesh]
    if bool((pos < 0).any()):
        return None
    origin = pos.flatten()[0]
    strides = []
    expect = torch.zeros_like(pos) + origin
    for d in range(mesh.ndim):
        step = int(pos.narrow(d, 1, 1).flatten()[0] - origin) if mesh.shape[d] > 1 else 0
        if step < 0:
            return None
        strides.append(step)
        shape = [1] * mesh.ndim
        shape[d] = mesh.shape[d]
        expect = expect + torch.arange(mesh.shape[d], dtype=torch.int64).reshape(shape) * step
    if not torch.equal(expect, pos):
        return None
    lay = MeshLayout.from_sizes_strides(tuple(mesh.shape), strides)
    if lay.complement(rank_map.numel()) is None:
        return None
    # The mesh must be one of the layout's copies (ranks 1, 2 of 0..3 are no copy of 2:1).
    rows = lay.positions(rank_map.numel()).flatten(1)
    return lay if bool((rows == pos.flatten()).all(1).any()) else None
