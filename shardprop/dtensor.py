"""The DTensor subclass: a local shard plus the spec that says where it sits.

Shape, stride, dtype, device and requires_grad of the wrapper are the global
ones; ``_local_tensor`` holds this rank's shard. Every aten op on it goes through
``shardprop.dispatch``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from shardprop.layout import local_shape_and_offset
from shardprop.placement import Replicate, normalize_placements
from shardprop.spec import DTensorSpec, TensorMeta


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


class DTensor(torch.Tensor):
    """A tensor distributed over a DeviceMesh.

    Example:
        >>> x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])  # doctest: +SKIP
        >>> x.placements, x.to_local().shape  # doctest: +SKIP
        ((S(0),), torch.Size([2, 4]))
    """

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    # Set (a weakref to the base) on results of view ops that had to copy: see dispatch._copied_view.
    _view_base = None
    _view_op = None
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False):
        meta = spec.tensor_meta
        r = torch.Tensor._make_wrapper_subclass(
            cls, meta.shape, strides=meta.stride, dtype=meta.dtype, device=local_tensor.device,
            layout=local_tensor.layout, requires_grad=requires_grad)
        r._local_tensor = local_tensor
        r._spec = spec
        return r

    def __init__(self, *args, **kwargs):
        pass

    def __repr__(self) -> str:
        return (f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, "
                f"placements={list(self._spec.placements)})")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Replaced by shardprop.dispatch.torch_dispatch when shardprop is imported.
        raise RuntimeError("shardprop.dispatch is not imported: import shardprop")

    def __tensor_flatten__(self):
        return ["_local_tensor"], (self._spec, self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        spec, requires_grad = flatten_spec
        return DTensor(inner_tensors["_local_tensor"], spec, requires_grad=requires_grad)

    # ---- public API -------------------------------------------------------------------
    @property
    def placements(self):
        """The placement on each mesh dim, e.g. ``(S(0), R)``."""
        return self._spec.placements

    @property
    def device_mesh(self):
        """The DeviceMesh this tensor lives on."""
        return self._spec.mesh

    @staticmethod
    def from_local(local_tensor: torch.Tensor, device_mesh=None, placements=None, *, run_check: bool = False,
                   shape: Optional[Sequence[int]] = None, stride: Optional[Sequence[int]] = None) -> "DTensor":
        """Wrap this rank's shard as a DTensor (differentiable).

        Without ``shape``, shards are assumed even; ``run_check=True`` gathers every
        rank's local shape, derives the global shape (uneven shards included) and
        raises on every rank if they are inconsistent.

        Example:
            >>> dt = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])  # doctest: +SKIP
            >>> dt.shape  # 4 ranks  # doctest: +SKIP
            torch.Size([8, 4])
        """
        from shardprop import autograd_fns
        return autograd_fns.FromLocal.apply(local_tensor, device_mesh, placements, run_check, shape, stride)

    def to_local(self, *, grad_placements=None) -> torch.Tensor:
        """This rank's shard as a plain tensor (differentiable).

        ``grad_placements`` says how the gradient flowing back into the shard is laid out
        (default: this tensor's placements).

        Example:
            >>> dt.to_local().shape  # doctest: +SKIP
        """
        if not torch.is_grad_enabled() or not self.requires_grad:
            return self._local_tensor
        from shardprop import autograd_fns
        return autograd_fns.ToLocal.apply(self, grad_placements)

    def redistribute(self, device_mesh=None, placements=None, *, async_op: bool = False) -> "DTensor":
        """The same tensor laid out with ``placements`` (differentiable).

        Example:
            >>> dt.redistribute(placements=[Replicate()])  # doctest: +SKIP
        """
        from shardprop import autograd_fns
        mesh = self._spec.mesh
        if device_mesh is not None and device_mesh != mesh:
            raise ValueError(f"redistribute: cannot move a DTensor from {mesh} to a different mesh {device_mesh}; "
                             "redistribution happens within one mesh")
        if placements is None:
            raise ValueError("redistribute: give the target placements")
        placements = normalize_placements(placements, self.ndim, mesh.ndim, "redistribute")
        return autograd_fns.Redistribute.apply(self, placements, async_op)

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        """The whole global tensor on every rank (differentiable).

        Example:
            >>> dt.full_tensor().shape  # doctest: +SKIP
        """
        full = self.redistribute(placements=[Replicate()] * self._spec.mesh.ndim)
        return full.to_local(grad_placements=grad_placements)


def make_spec(mesh, placements, shape, stride=None, dtype=torch.float32) -> DTensorSpec:
    """A spec for a global tensor of ``shape`` (contiguous strides unless given)."""
    shape = torch.Size(shape)
    stride = tuple(stride) if stride is not None else _contiguous_stride(shape)
    return DTensorSpec(mesh, tuple(placements), TensorMeta(shape, stride, dtype))


def local_chunk(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's shard of a full tensor, cut locally with no communication."""
    shape, offset = local_shape_and_offset(full.shape, mesh.shape, mesh._coord, placements)
    out = full
    for d, (off, ln) in enumerate(zip(offset, shape)):
        if ln != full.shape[d]:
            out = out.narrow(d, off, ln)
    return out.contiguous()

