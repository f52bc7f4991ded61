"""The torch.distributed.checkpoint (DCP) protocol for DTensor.

DCP asks a tensor subclass three things (``torch/distributed/checkpoint/planner_helpers.py``):

- ``__create_write_items__(fqn, obj)``: what this rank would write, one ``WriteItem`` for its
  box (:func:`chunks.shard_box`). Replicas name the same box, so DCP's plan de-duplication
  keeps one writer per box: no replica is written twice.
- ``__create_chunk_list__()``: the box this rank wants when loading; DCP's planner then reads
  only the stored pieces overlapping it, whatever mesh and placements wrote them (resharding).
- ``__get_tensor_shard__(index)``: the plain tensor to write from, or to read into (the local
  shard itself, so a load lands in place).

``Partial`` values are reduced before they are written (collectively, on the tensor's mesh,
while DCP plans: every rank of the mesh plans every entry in the same order; ``dcp.async_save``
plans in a background thread, where this raises instead: reduce such values first). Loading into a
``Partial(sum)`` tensor fills the first rank along each partial mesh dim and zeros the others;
the other reduce ops hold the value on every rank. Ranks outside the tensor's mesh write and
read nothing.

The files are ordinary DCP checkpoints: ``dcp_to_torch_save`` and ``dcp.load`` into plain
tensors read them without shardprop.

Example:
    >>> import torch.distributed.checkpoint as dcp
    >>> dcp.save({"model": model.state_dict()}, checkpoint_id="ckpt")          # doctest: +SKIP
    >>> dcp.load({"model": other_layout_model.state_dict()}, checkpoint_id="ckpt")  # doctest: +SKIP
"""
from __future__ import annotations

import threading

import torch

from shardprop.checkpoint.chunks import shard_box
from shardprop.mesh.async_tensor import wait_all
from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.placement import Partial, has_strided, without_partial
from shardprop.tensor.redistribute import redistribute_local
from shardprop.tensor.strided import strided_box


def _box(dt: DTensor):
    spec = dt._spec
    if has_strided(spec.placements):
        # A strided shard is usually several runs of the global tensor: one chunk would silently save (and
        # load) the wrong elements. Nested under a Shard of the same dim it is one run, and one box.
        box = strided_box(spec.shape, spec.mesh.shape, spec.mesh._coord, spec.placements)
        if box is None:
            raise NotImplementedError(f"DCP: a DTensor laid out as {list(spec.placements)} (a _StridedShard) has "
                                      "several chunks on this rank; redistribute it to Shard/Replicate placements "
                                      "to save it")
        return box
    return shard_box(spec.shape, spec.mesh.shape, spec.mesh._coord, spec.placements)


def _value_to_write(dt: DTensor) -> torch.Tensor:
    """This rank's shard of the true value: Partial mesh dims reduced (a collective on the mesh)."""
    spec = dt._spec
    local = wait_all(dt._local_tensor)
    if spec.has_partial:
        if threading.current_thread() is not threading.main_thread():
            # dcp.async_save plans in a background thread, while the training thread may be using the
            # same process groups: a collective here could interleave with the step's and hang.
            raise ValueError(f"dcp.async_save: a DTensor with placements {list(spec.placements)} would need a "
                             "reduction in DCP's background thread; redistribute Partial to Replicate first")
        target = without_partial(spec.placements)
        local = redistribute_local(local, spec, target)
    return local


def create_write_items(self: DTensor, fqn: str, obj=None) -> list:
    """DCP protocol: one shard write item for this rank's box (none outside the mesh).

    Example:
        >>> dt.__create_write_items__("w", dt)[0].index.offset  # doctest: +SKIP
        torch.Size([2, 0])
    """
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    self.__dict__.pop("_dcp_value", None)
    if self._spec.mesh._coord is None:
        return []
    local = _value_to_write(self)  # before any early return: a Partial's reduction is collective
    offsets, sizes = _box(self)
    if 0 in sizes and (self._spec.shape.numel() != 0 or any(self._spec.mesh._coord)):
        # An empty piece (uneven shards) writes nothing: its box could share its offset with a real
        # piece (e.g. [1] of size 0 beside [1] of size 1), and DCP's de-duplication by offset would
        # then keep either. An empty tensor is still described once, by the mesh's first rank.
        return []
    if self._spec.has_partial:  # kept until DCP asks for the data (the reduction cannot run then)
        self.__dict__["_dcp_value"] = local
    offsets, sizes = torch.Size(offsets), torch.Size(sizes)
    return [WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties.create_from_tensor(local),
            size=self._spec.shape),
    )]


def create_chunk_list(self: DTensor) -> list:
    """DCP protocol: the box this rank loads into (none outside the mesh, or where a sum partial keeps zeros).

    Example:
        >>> dt.__create_chunk_list__()  # doctest: +SKIP
        [ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([2, 4]))]
    """
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    self.__dict__.pop("_dcp_value", None)
    spec = self._spec
    coord = spec.mesh._coord
    if coord is None:
        return []
    if any(type(p) is Partial and p.reduce_op == "sum" and coord[m] != 0 for m, p in enumerate(spec.placements)):
        self._local_tensor.zero_()  # the value sits on the first rank along a sum partial dim
        return []
    offsets, sizes = _box(self)
    return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))]


def get_tensor_shard(self: DTensor, index) -> torch.Tensor:
    """DCP protocol: the plain tensor behind this rank's box (the local shard: loads land in place).

    Example:
        >>> dt.__get_tensor_shard__(index) is dt.to_local()  # doctest: +SKIP
        True
    """
    value = self.__dict__.pop("_dcp_value", None)
    return value if value is not None else wait_all(self._local_tensor)


# DTensor's __create_write_items__/__create_chunk_list__/__get_tensor_shard__ are the functions above,
# given to the class in shardprop/assembly.py. (dcp.async_save's stager deep-copies a tensor's
# attributes: DTensorSpec.__deepcopy__ returns the spec itself, so no copy of its mesh's groups.)
