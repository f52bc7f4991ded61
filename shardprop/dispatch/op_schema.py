"""Value types of sharding propagation: the cache key and the cached answer.

``OpSchema`` is an op call with every DTensor replaced by its spec and every
non-tensor argument in hashable form; its hash is computed once. ``OutputSharding``
is what propagation decides for it. Both are immutable: cached objects must never
change under the cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from shardprop.tensor.spec import DTensorSpec


class _Marker:
    """A stand-in in cache keys for a value whose exact content does not matter."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name

    def __reduce__(self):
        return (_marker, (self.name,))


_MARKERS = {}


def _marker(name: str) -> _Marker:
    if name not in _MARKERS:
        _MARKERS[name] = _Marker(name)
    return _MARKERS[name]


# A Python float: its value never changes sharding, so all floats share cache entries
# (multiplying by a new learning rate is a hit). Rules see this marker, not the value.
FLOAT = _marker("<float>")
COMPLEX = _marker("<complex>")


@dataclass(frozen=True)
class ScalarTensor:
    """A plain 0-dim tensor argument: replicated by definition; only its meta is in the key."""

    dtype: Any
    device: Any


class OpSchema(tuple):
    """An op call as a hashable cache key: ``(hash, op, args, kwargs)``.

    ``args``/``kwargs`` hold specs for DTensors, tuples for lists, markers for
    floats. A tuple subclass so equality on a cache hit runs in C (element
    identity first); the hash is computed once, at creation. Immutable.

    Example:
        >>> OpSchema(aten.mm.default, (spec_a, spec_b), ())  # doctest: +SKIP
    """

    __slots__ = ()

    def __new__(cls, op, args: tuple, kwargs: tuple, op_hash: int = None):
        try:
            h = hash((hash(op) if op_hash is None else op_hash, args, kwargs))
        except TypeError:  # symbolic sizes (torch.compile, dynamic shapes): never a cache key
            h = None
        return tuple.__new__(cls, (h, op, args, kwargs))

    @property
    def cacheable(self) -> bool:
        """False when the call holds symbolic sizes: hashing it (a cache lookup) raises TypeError."""
        return self[0] is not None

    def __hash__(self) -> int:
        return self[0]

    op = property(lambda self: self[1], doc="The aten OpOverload.")
    args = property(lambda self: self[2], doc="Positional arguments in key form.")
    kwargs = property(lambda self: self[3], doc="Keyword arguments as a tuple of (name, value).")

    @property
    def specs(self) -> Tuple[DTensorSpec, ...]:
        """The DTensor specs among the arguments, in order (args, then kwargs)."""
        out = []
        _collect_specs(self.args, out)
        _collect_specs(tuple(v for _, v in self.kwargs), out)
        return tuple(out)

    @property
    def kwargs_dict(self) -> dict:
        return dict(self.kwargs)

    def __repr__(self) -> str:
        return f"OpSchema({self.op}, {self.args}, {dict(self.kwargs)})"


def _collect_specs(items, out) -> None:
    for a in items:
        if type(a) is DTensorSpec:
            out.append(a)
        elif type(a) is tuple:
            _collect_specs(a, out)


@dataclass(frozen=True)
class Candidate:
    """One strategy considered for one mesh dim: its placements and its redistribution cost."""

    mesh_dim: int
    inputs: tuple
    outputs: tuple
    cost: float


@dataclass(frozen=True)
class OutputSharding:
    """Propagation's answer for one OpSchema (cached).

    ``in_specs`` are the layouts the inputs must have (aligned with
    ``OpSchema.specs``); ``plans`` the redistribution for each input that needs
    one (None otherwise); ``out_specs`` one spec per tensor output (None for
    non-tensor outputs); ``returns`` how the result is shaped: "tensor", "tuple",
    "list", "view" / "view_list" (a view op's one tensor or list: see
    ``dispatcher._wrap_view``), "self" (in-place: return the first argument) or "out"
    (return the ``out=`` argument).
    """

    out_specs: tuple
    in_specs: tuple
    plans: tuple
    needs_redistribute: bool
    returns: str
    candidates: tuple = ()
    local_call: Optional[object] = None  # replaces op(*local_args) where the plain call is wrong
    outside: bool = False  # this rank is not in the mesh: local_call makes default outputs (dispatch.outside)
