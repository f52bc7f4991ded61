"""Placements: how a tensor is laid out along one mesh dim.

Immutable and hashable (they are parts of cache keys), with short reprs so a
list of them reads like ``[S(0), R]``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from shardprop.mesh import compat

REDUCE_OPS = ("sum", "avg", "max", "min", "product")
# Other spellings a user may give (torch.distributed.ReduceOp calls it PRODUCT; torch.prod "prod").
_ALIASES = {"prod": "product"}


class Placement(compat.PLACEMENT_BASE):  # on 2.11 compile needs this base to hold a placement as a value
    """Base of Shard, _StridedShard, Replicate and Partial.

    Example:
        >>> [p.is_shard() for p in (Shard(0), Replicate(), Partial())]
        [True, False, False]
        >>> Shard(1).is_shard(dim=1), Replicate().is_replicate(), Partial().is_partial()
        (True, True, True)
    """

    __slots__ = ()

    def is_shard(self, dim=None) -> bool:
        """True for Shard (of ``dim``, if given); False for ``_StridedShard``, as torch answers."""
        return False

    def is_replicate(self) -> bool:
        """True for Replicate."""
        return False

    def is_partial(self) -> bool:
        """True for Partial."""
        return False

    def __fx_repr__(self):
        """How generated graph code names this placement (torch.compile's opaque value-type protocol).

        Compiled code that reads a DTensor's placements holds them as constants (guarded by ``==``);
        the class travels under a name of its own so it never collides with torch's ``Shard``.
        """
        cls = type(self)
        args = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return f"_shardprop_{cls.__name__}({args})", {f"_shardprop_{cls.__name__}": cls}


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Split tensor dim ``dim`` across the mesh dim, in ``torch.chunk`` order.

    Example:
        >>> Shard(0)
        S(0)
    """

    dim: int

    def __post_init__(self):
        if not isinstance(self.dim, int):
            raise TypeError(f"Shard: dim must be an int, got {self.dim!r}")

    def is_shard(self, dim=None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class _StridedShard(Placement):
    """Shard tensor dim ``dim`` as if this mesh dim split it *after* ``split_factor`` pieces were cut.

    torch's layout for a mesh dim that shards a tensor dim right-to-left (FSDP over TP-sharded
    parameters, flattened views): the dim is chunked into ``split_factor`` pieces, each piece is
    chunked into as many parts as the mesh dim has ranks, and rank ``r`` holds part ``r`` of every
    piece, concatenated. So a rank's shard is several runs of the global dim, not one.
    ``is_shard()`` is False, as torch's (2.15) answers: code asking "is this a plain chunk" must
    not take it for one.

    Example:
        >>> _StridedShard(0, split_factor=2)  # on 2 ranks, rows [0..7] -> rank 0: [0, 1, 4, 5]
        _S(0, sf=2)
    """

    dim: int
    split_factor: int = 1

    def __post_init__(self):
        if not isinstance(self.dim, int):
            raise TypeError(f"_StridedShard: dim must be an int, got {self.dim!r}")
        if not isinstance(self.split_factor, int) or self.split_factor < 1:
            raise ValueError(f"_StridedShard: split_factor must be an int >= 1, got {self.split_factor!r}")

    def __repr__(self) -> str:
        return f"_S({self.dim}, sf={self.split_factor})"


def is_shard_like(p) -> bool:
    """True for ``Shard`` and ``_StridedShard``: placements that split a tensor dim across a mesh dim.

    Example:
        >>> is_shard_like(Shard(0)), is_shard_like(_StridedShard(0, split_factor=2)), is_shard_like(Replicate())
        (True, True, False)
    """
    return type(p) is Shard or type(p) is _StridedShard


def has_strided(placements) -> bool:
    """True when some placement is a ``_StridedShard`` (what routes layout and planning to the strided code).

    Example:
        >>> has_strided((Shard(0), _StridedShard(1, split_factor=2))), has_strided((Shard(0),))
        (True, False)
    """
    return any(type(p) is _StridedShard for p in placements)


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank along the mesh dim holds the whole tensor.

    Example:
        >>> Replicate()
        R
    """

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Each rank holds a partial value; the true value reduces them with ``reduce_op``.

    Example:
        >>> Partial()
        P(sum)
    """

    reduce_op: str = "sum"

    def __post_init__(self):
        if self.reduce_op in _ALIASES:  # one spelling, so Partial("prod") == Partial("product")
            object.__setattr__(self, "reduce_op", _ALIASES[self.reduce_op])
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(f"Partial: reduce_op must be one of {REDUCE_OPS}, got {self.reduce_op!r}")

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"P({self.reduce_op})"


def partial_fill(placements, coord):
    """What this rank holds of a value laid out as ``placements`` that is not its to hold, or None.

    A sum (product) Partial keeps the value on index 0 of its mesh dim and zeros (ones)
    elsewhere; avg, max and min keep it everywhere. Zero wins over one: with a sum and a
    product on different mesh dims the value comes back in either order of reduction.

    Example:
        >>> partial_fill((Partial("product"),), (2,)), partial_fill((Partial("max"),), (2,))
        (1, None)
    """
    fill = None
    for m, p in enumerate(placements):
        if type(p) is Partial and coord[m] != 0:
            if p.reduce_op == "sum":
                return 0
            if p.reduce_op == "product":
                fill = 1
    return fill


def as_placement(p):
    """``p`` as one of our placements: ours as they are, torch's (or ``spmd_types``') by their shape, else None.

    Programs written for torch build placements with torch's classes (``torch.distributed.tensor.Shard(0)``),
    and packages such as ``spmd_types`` hand out torch's objects too. They are recognised by duck typing
    (the methods every torch placement has, and ``dim`` / ``reduce_op``), never by importing torch's module.

    torch's ``_StridedShard`` (recognised by its ``split_factor``) becomes ours, same dim and factor.

    Example:
        >>> class TorchShard:  # a stand-in with torch's Shard's shape
        ...     dim = 1
        ...     def is_shard(self, dim=None): return True
        >>> as_placement(TorchShard()), as_placement(Replicate()), as_placement("S(0)")
        (S(1), R, None)
    """
    if isinstance(p, Placement):
        return p
    try:
        sf = getattr(p, "split_factor", None)
        if sf is not None:  # torch's _StridedShard (before is_shard: older torch answers True for it)
            return _StridedShard(int(p.dim), split_factor=int(sf))
        if callable(getattr(p, "is_shard", None)) and p.is_shard():
            return Shard(int(p.dim))
        if callable(getattr(p, "is_replicate", None)) and p.is_replicate():
            return Replicate()
        if callable(getattr(p, "is_partial", None)) and p.is_partial():
            op = getattr(p, "reduce_op", "sum")
            return Partial(getattr(op, "name", op).lower() if not isinstance(op, str) else op)
    except (TypeError, ValueError, AttributeError):
        return None
    return None


def normalize_placements(placements, ndim: int, mesh_ndim: int, where: str = "placements") -> tuple:
    """Check a placement list against a tensor rank and mesh; make shard dims non-negative.

    Example:
        >>> normalize_placements([Shard(-1)], 2, 1)
        (S(1),)
    """
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ValueError(f"{where}: {len(placements)} placements {list(placements)} for a {mesh_ndim}-d mesh; "
                         f"give one placement per mesh dim")
    out = []
    for given in placements:
        p = as_placement(given)
        if p is None:
            raise TypeError(f"{where}: {given!r} is not a placement (use Shard(d), Replicate() or Partial())")
        if type(p) is Shard or type(p) is _StridedShard:
            if not -ndim <= p.dim < ndim:
                raise ValueError(f"{where}: {p!r} is out of range for a {ndim}-d tensor")
            if p.dim < 0:
                p = Shard(p.dim + ndim) if type(p) is Shard else _StridedShard(p.dim + ndim, split_factor=p.split_factor)
        out.append(p)
    return tuple(out)


def without_partial(placements) -> tuple:
    """``placements`` with every ``Partial`` as ``Replicate``: what a reduced value, or a gradient flowing back
    to a tensor laid out as ``placements``, takes.

    Example:
        >>> without_partial((Partial(), Shard(0)))
        (R, S(0))
    """
    return tuple(Replicate() if type(p) is Partial else p for p in placements)
