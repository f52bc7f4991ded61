"""DTensorSpec: mesh + placements + global tensor meta, immutable and hashable.

A spec is part of every cache key, so its hash is computed once at creation and
equality short-cuts on identity.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Tuple

import torch

from shardprop.placement import Partial, Placement, Replicate, Shard


class TensorMeta(NamedTuple):
    """Global shape, stride and dtype of a distributed tensor."""

    shape: torch.Size
    stride: Tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, eq=False)
class DTensorSpec:
    """How a global tensor is laid out over a mesh.

    Example:
        >>> spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size([8]), (1,), torch.float32))  # doctest: +SKIP
        >>> spec.placements  # doctest: +SKIP
        (S(0),)
    """

    mesh: object
    placements: Tuple[Placement, ...]
    tensor_meta: TensorMeta
    _hash: int = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.mesh, self.placements, self.tensor_meta)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        return (isinstance(other, DTensorSpec) and self._hash == other._hash and self.placements == other.placements
                and self.tensor_meta == other.tensor_meta and self.mesh == other.mesh)

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
