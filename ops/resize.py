"""``resize_`` / ``resize_as_`` on DTensors, and the layout conversions shardprop refuses (``to_sparse``).

``resize_`` keeps the first ``min(old, new)`` elements of the tensor's storage in order and gives the
tensor the new shape (contiguous). A DTensor's storage is its dense global tensor, so the DTensor
is gathered (a no-op when replicated), resized on every rank, and becomes Replicate with the new
shape. The wrapper's shape is changed in place, as for the in-place views. Growing a DTensor past
its number of elements raises a ``ShardingError``: the wrapper has no storage to grow (torch would
also leave the new elements uninitialized, which could differ between ranks).

Sparse layouts (``to_sparse``, ``to_sparse_csr``, ...): a DTensor's local tensors are strided; a
conversion raises a ``ShardingError`` naming the op and the placements (convert ``full_tensor()``
or ``to_local()`` instead).

Example:
    >>> x = distribute_tensor(torch.arange(12.).reshape(3, 4), mesh, [Shard(0)])  # doctest: +SKIP
    >>> x.resize_(2, 6).placements  # doctest: +SKIP
    (Replicate(),)
"""
from __future__ import annotations

import torch

from shardprop.dispatch import dispatcher as _dispatch
from shardprop.dispatch.propagate import ShardingError
from shardprop.mesh.compat import aten_ops
from shardprop.tensor.dtensor import DTensor, make_spec
from shardprop.tensor.placement import Replicate
from shardprop.tensor.redistribute import redistribute_local

from .view import _set_wrapper_meta

aten = torch.ops.aten
R = Replicate()


def _resize(op, x: DTensor, size) -> DTensor:
    spec = x._spec
    mesh = spec.mesh
    local = x._local_tensor
    if not spec.is_replicated:
        local = redistribute_local(local, spec, (R,) * mesh.ndim)
    old = local.numel()
    new = 1
    for n in size:
        new *= n
    if new > spec.tensor_meta.shape.numel():
        # The wrapper tensor has no storage of its own to grow (its data lives in the shards).
        raise ShardingError(f"shardprop: {op} of a DTensor (placements {list(spec.placements)}, shape "
                            f"{tuple(x.shape)}) to {list(size)} would grow it from {old} to {new} elements; "
                            "a DTensor can keep or shrink its number of elements only (make a new one)")
    if not local.is_contiguous() or local.storage_offset() != 0 or local.untyped_storage().nbytes() != \
            old * local.element_size():
        local = local.clone(memory_format=torch.contiguous_format)  # a storage of its own, in order
    local = local.resize_(size)
    x._local_tensor = local
    x._spec = make_spec(mesh, (R,) * mesh.ndim, local.shape, local.stride(), local.dtype)
    _set_wrapper_meta(x, x._spec)
    return x


def _resize_handler(op, args, kwargs):
    kwargs = dict(kwargs or {})
    x = args[0]
    if kwargs.get("memory_format") not in (None, torch.contiguous_format):
        raise ShardingError(f"{op}: memory_format={kwargs['memory_format']} on a DTensor (placements "
                            f"{list(x._spec.placements)}): only the contiguous format is supported")
    if op is aten.resize_as_.default:
        other = args[1]
        return _resize(op, x, tuple(other.shape))
    return _resize(op, x, tuple(args[1]))


def _sparse_refusal(op, args, kwargs):
    x = args[0]
    where = f"placements {list(x._spec.placements)}" if isinstance(x, DTensor) else "a DTensor argument"
    raise ShardingError(f"shardprop: {op} converts to a sparse layout, and DTensors are strided only "
                        f"(input {where}, shape {tuple(x.shape)}); convert x.full_tensor() or x.to_local() instead")


for _op in (aten.resize_.default, aten.resize_as_.default):
    _dispatch.register_special(_op, _resize_handler)
SPARSE = ["_to_sparse", "_to_sparse_csr", "_to_sparse_csc", "_to_sparse_bsr", "_to_sparse_bsc", "to_sparse",
          "to_sparse_csr", "to_sparse_csc", "to_sparse_bsr", "to_sparse_bsc", "_to_sparse_semi_structured"]
for _op in aten_ops(SPARSE, None):
    _dispatch.register_special(_op, _sparse_refusal)
