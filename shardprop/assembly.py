"""Where the rooms are wired together, in one visible place.

The layering lets a room import only the rooms below it, so a class or hook list defined low down
cannot import what the rooms above give it. Instead of each room editing the class or a lower
module from inside itself, everything of that kind is listed here and done once, when ``shardprop``
is imported:

- :data:`DTENSOR_METHODS`: DTensor's methods defined outside ``tensor/dtensor.py`` (the dispatcher,
  the conversions' autograd functions, the pickling and DCP protocols).
- :func:`assemble`: the hooks between rooms (cross-mesh moves for ``redistribute``, plain state dict
  loading for parallelized modules).

``tests/test_layout.py`` fails on any other module that writes into another product module's
attributes or into a class defined elsewhere.

Example:
    >>> from shardprop.assembly import DTENSOR_METHODS
    >>> sorted(name for name, _ in DTENSOR_METHODS)[:2]
    ['__create_chunk_list__', '__create_write_items__']
"""
from __future__ import annotations

# Imported for what their import registers: the built-in sharding rules (ops), the random-op handlers,
# the optimizer foreach hooks.
import shardprop.ops  # noqa: F401
from shardprop.dispatch import random_ops  # noqa: F401
from shardprop.parallel.fast import optim_foreach  # noqa: F401
from shardprop.checkpoint import cross_mesh, dcp, pickling
from shardprop.checkpoint.full_state_dict import enable_full_state_dict_loading
from shardprop.dispatch import dispatcher
from shardprop.parallel.tp import parallelize
from shardprop.tensor import conversions
from shardprop.tensor.dtensor import DTensor

# (name, value): DTensor's class attributes defined in rooms above its own.
DTENSOR_METHODS = (
    ("__torch_dispatch__", classmethod(dispatcher.torch_dispatch)),  # the engine: every aten op on a DTensor
    ("from_local", staticmethod(conversions.from_local)),
    ("to_local", conversions.to_local),
    ("redistribute", conversions.redistribute),
    ("full_tensor", conversions.full_tensor),
    ("__reduce_ex__", pickling.reduce_ex),  # pickle, torch.save/torch.load
    ("__setstate__", pickling.setstate),
    ("__deepcopy__", pickling.deepcopy_dtensor),
    ("__create_write_items__", dcp.create_write_items),  # torch.distributed.checkpoint
    ("__create_chunk_list__", dcp.create_chunk_list),
    ("__get_tensor_shard__", dcp.get_tensor_shard),
)


def assemble() -> None:
    """Give DTensor its methods and connect the rooms' hooks (run once, at ``import shardprop``)."""
    for name, value in DTENSOR_METHODS:
        setattr(DTensor, name, value)
    conversions.set_other_mesh_redistribute(cross_mesh.redistribute_to_mesh)
    # A parallelized module's load_state_dict takes plain full tensors (parallel may not import checkpoint).
    parallelize.add_on_distributed(enable_full_state_dict_loading)


assemble()
