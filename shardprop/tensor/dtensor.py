"""The DTensor subclass: a local shard plus the spec that says where it sits.

Shape, stride, dtype, device and requires_grad of the wrapper are the global
ones; ``_local_tensor`` holds this rank's shard. Every aten op on it goes through
``shardprop.dispatch.dispatcher``.
"""
from __future__ import annotations

from typing import Optional

import torch

from shardprop.tensor.compile_support import check_compile
from shardprop.tensor.layout import local_shape_and_offset
from shardprop.tensor import strided
from shardprop.tensor.placement import has_strided, without_partial
from shardprop.tensor.spec import DTensorSpec, TensorMeta


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def memory_order(local: torch.Tensor) -> Optional[tuple]:
    """``local``'s dims from outermost to innermost in memory; None for row-major (the common case).

    Contiguous, expanded and merely sliced tensors count as row-major: their global strides are
    the contiguous ones (see :func:`stride_like`).

    Example:
        >>> memory_order(torch.ones(3, 4).t())
        (1, 0)
        >>> memory_order(torch.ones(3, 4)) is None
        True
    """
    if local.is_contiguous():
        return None
    st = local.stride()
    n = len(st)
    if 0 in st or all(st[i] >= st[i + 1] for i in range(n - 1)):  # expanded or only sliced: keep row-major
        return None
    return tuple(sorted(range(n), key=lambda d: (-st[d], d)))


def stride_like(local: torch.Tensor, shape) -> tuple:
    """Global strides for ``shape`` that keep ``local``'s dim order (contiguous when ``local`` is).

    A DTensor's strides must describe its shard's memory order: view ops decide from
    the outer strides whether a view is possible, then run on the shard.

    Example:
        >>> stride_like(torch.ones(3, 4).t(), (8, 3))
        (1, 8)
    """
    order = memory_order(local)
    if order is None:
        return _contiguous_stride(shape)
    out, acc = [0] * len(shape), 1
    for d in reversed(order):
        out[d] = acc
        acc *= max(shape[d], 1)
    return tuple(out)


class DTensor(torch.Tensor):
    """A tensor distributed over a DeviceMesh.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        >>> x.placements, x.to_local().shape
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
        # Replaced by shardprop.dispatch.dispatcher.torch_dispatch in shardprop/assembly.py.
        raise RuntimeError("shardprop.dispatch is not imported: import shardprop")

    # ---- torch.compile: the traceable-subclass protocol ----------------------------------
    def __tensor_flatten__(self):
        """Inner tensor: the local shard. Context: (mesh, placements, requires_grad, coordinate).

        The context is what compiled code guards on (by equality, after a deep copy that keeps
        meshes themselves). The global shape is left out: it is the outer tensor's own size,
        which torch.compile tracks (and may make dynamic) on its own. The rank's mesh
        coordinate is in it because the traced graph depends on it (which chunk a rank cuts,
        which rank keeps a Partial value): compile caches keyed on the context must not hand
        one rank's graph to another.
        """
        check_compile()  # only compile flattens a DTensor: say so if compile cannot work here
        spec = self._spec
        return ["_local_tensor"], (spec.mesh, spec.placements, self.requires_grad, spec.mesh._coord)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        mesh, placements, requires_grad, _ = flatten_spec
        local = inner_tensors["_local_tensor"]
        spec = make_spec(mesh, placements, outer_size, outer_stride, local.dtype)
        return DTensor(local, spec, requires_grad=requires_grad)

    def __coerce_tangent_metadata__(self):
        # A Partial gradient flowing into a compiled backward becomes Replicate (one all-reduce),
        # so the tangent's layout does not depend on how this rank's backward produced it.
        if not self._spec.has_partial:
            return self
        return self.redistribute(placements=without_partial(self._spec.placements))

    def __coerce_same_metadata_as_tangent__(self, flatten_spec, expected_type=None):
        if expected_type is not None:
            return None
        return self.redistribute(placements=flatten_spec[1])

    # ---- public API -------------------------------------------------------------------
    @property
    def placements(self):
        """The placement on each mesh dim, e.g. ``(S(0), R)``."""
        return self._spec.placements

    @property
    def device_mesh(self):
        """The DeviceMesh this tensor lives on."""
        return self._spec.mesh

    # from_local, to_local, redistribute and full_tensor are differentiable: they are attached by
    # shardprop.tensor.conversions, beside the autograd functions they call.


def make_spec(mesh, placements, shape, stride=None, dtype=torch.float32) -> DTensorSpec:
    """A spec for a global tensor of ``shape`` (contiguous strides unless given)."""
    shape = torch.Size(shape)
    stride = tuple(stride) if stride is not None else _contiguous_stride(shape)
    return DTensorSpec(mesh, tuple(placements), TensorMeta(shape, stride, dtype))


def local_chunk(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's shard of a full tensor, cut locally with no communication (empty outside the mesh)."""
    if mesh._coord is None:
        return full.new_empty(0)
    if has_strided(placements):  # several runs per dim: picked by index, not narrowed
        return strided.pick(full, mesh.shape, mesh._coord, placements)
    shape, offset = local_shape_and_offset(full.shape, mesh.shape, mesh._coord, placements)
    out = full
    for d, (off, ln) in enumerate(zip(offset, shape)):
        if ln != full.shape[d]:
            out = out.narrow(d, off, ln)
    return out.contiguous()

