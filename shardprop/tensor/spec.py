"""DTensorSpec: mesh + placements + global tensor meta, immutable and hashable.

A spec is part of every cache key, so its hash is computed once at creation and
equality short-cuts on identity.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import NamedTuple, Tuple

import torch

from shardprop.tensor.layout import local_shape_and_offset
from shardprop.tensor.placement import Partial, Placement, Replicate, Shard, without_partial


class TensorMeta(NamedTuple):
    """Global shape, stride and dtype of a distributed tensor.

    Example:
        >>> x = distribute_tensor(torch.ones(8, 4), init_device_mesh("cpu", (4,)), [Shard(0)])
        >>> x._spec.tensor_meta
        TensorMeta(shape=torch.Size([8, 4]), stride=(4, 1), dtype=torch.float32)
    """

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
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size([8]), (1,), torch.float32))
        >>> spec is DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size([8]), (1,), torch.float32))
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

    def without_partial(self) -> "DTensorSpec":
        """The same tensor with each ``Partial`` as ``Replicate`` (itself when it has none).

        Example:
            >>> spec.without_partial().placements  # doctest: +SKIP
            (Replicate(), Shard(dim=0))
        """
        return self.with_placements(without_partial(self.placements)) if self.has_partial else self

    def local_box(self, placements=None) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """This rank's (local shape, offset in the global tensor), laid out as ``placements`` (default: the spec's).

        Example:
            >>> spec.local_box()  # Shard(0) of an (8, 4) tensor on rank 1 of 4  # doctest: +SKIP
            ((2, 4), (2, 0))
        """
        mesh = self.mesh
        return local_shape_and_offset(self.tensor_meta.shape, mesh.shape, mesh._coord,
                                      self.placements if placements is None else placements)

    def contiguous(self) -> "DTensorSpec":
        """The same tensor with contiguous strides (itself when they are; cached: specs are interned).

        Example:
            >>> spec.t().contiguous() is spec.t()  # doctest: +SKIP
            False
        """
        return _contiguous(self)


@functools.lru_cache(maxsize=4096)
def _contiguous(spec: DTensorSpec) -> DTensorSpec:
    stride, acc = [], 1
    for n in reversed(spec.tensor_meta.shape):
        stride.append(acc)
        acc *= max(n, 1)
    stride = tuple(reversed(stride))
    if stride == spec.tensor_meta.stride:
        return spec
    return DTensorSpec(spec.mesh, spec.placements, TensorMeta(spec.tensor_meta.shape, stride, spec.tensor_meta.dtype))


# Weak values: a spec lives as long as a DTensor or a cache entry holds it.
DTensorSpec._pool = weakref.WeakValueDictionary()
