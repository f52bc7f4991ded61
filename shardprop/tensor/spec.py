"""DTensorSpec: mesh + placements + global tensor meta, immutable and hashable.

A spec is part of every cache key, so its hash is computed once at creation and
equality short-cuts on identity.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple, Tuple

import torch

from shardprop.tensor.placement import Partial, Placement, Replicate, Shard


class TensorMeta(NamedTuple):
    """Global shape, stride and dtype of a distributed tensor."""

    shape: torch.Size
    stride: Tuple[int, ...]
    dtype: torch.dtype


class _Interned(type):
    """Metaclass: equal specs are one object, so cache keys hash and compare them by identity (in C)."""

    def __call__(cls, mesh, placements, tensor_meta):
        key = (mesh, placements, tensor_meta)
        try:
            spec = cls._pool.get(key)
        except TypeError:  # symbolic sizes (torch.compile with dynamic shapes) do not hash
            return super().__call__(mesh, placements, tensor_meta)
        if spec is None:
            spec = super().__call__(mesh, placements, tensor_meta)
            cls._pool[key] = spec
        return spec


@dataclass(frozen=True, eq=False)
class DTensorSpec(metaclass=_Interned):
    """How a global tensor is laid out over a mesh (interned: one object per distinct spec).

    Example:
        >>> spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size([8]), (1,), torch.float32))  # doctest: +SKIP
        >>> spec is DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size([8]), (1,), torch.float32))  # doctest: +SKIP
        True
    """

    mesh: object
    placements: Tuple[Placement, ...]
    tensor_meta: TensorMeta

    # Identity hash and equality (object's, in C): interning makes them value semantics.
    __hash__ = object.__hash__
    __eq__ = object.__eq__

    @property
    def is_symbolic(self) -> bool:
        """Whether the global shape or stride holds symbolic sizes (torch.compile, dynamic shapes).

        Such a spec is not interned: it equals only itself, so cached propagation never
        reuses a result computed for it.
        """
        return not all(type(s) is int for s in self.tensor_meta.shape) or \
            not all(type(s) is int for s in self.tensor_meta.stride)

    def __deepcopy__(self, memo):
        return self  # immutable and interned; torch.compile deep-copies guard metadata

    def __reduce__(self):
        return (DTensorSpec, (self.mesh, self.placements, self.tensor_meta))

    def __repr__(self) -> str:
        return f"Spec({list(self.placements)}, shape={tuple(self.shape)}, {self.dtype})"

    @property
    def shape(self) -> torch.Size:
        return self.tensor_meta.shape

    @property
    def ndim(self) -> int:
        return len(self.tensor_meta.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor_meta.dtype

    def with_placements(self, placements) -> "DTensorSpec":
        """The same tensor on the same mesh, laid out differently."""
        return DTensorSpec(self.mesh, tuple(placements), self.tensor_meta)

    def shard_mesh_dims(self, tensor_dim: int) -> Tuple[int, ...]:
        """Mesh dims that shard ``tensor_dim``, outermost first."""
        return tuple(m for m, p in enumerate(self.placements) if type(p) is Shard and p.dim == tensor_dim)

    @property
    def is_replicated(self) -> bool:
        return all(type(p) is Replicate for p in self.placements)

    @property
    def has_partial(self) -> bool:
        return any(type(p) is Partial for p in self.placements)


# Weak values: a spec lives as long as a DTensor or a cache entry holds it.
DTensorSpec._pool = weakref.WeakValueDictionary()
