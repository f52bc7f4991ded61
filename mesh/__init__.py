"""shardprop.mesh: device meshes, their process groups, and collectives over mesh dims."""
from shardprop.mesh.async_tensor import AsyncTensor
from shardprop.mesh.collectives import all_gather, all_reduce, all_to_all, broadcast, reduce_scatter, scatter
from shardprop.mesh.device_mesh import DeviceMesh, init_device_mesh
from shardprop.mesh.groups import collective_timeout, set_collective_timeout
from shardprop.mesh.uneven_all_to_all import all_to_all_uneven, exchange_splits

__all__ = [
    "AsyncTensor", "DeviceMesh", "init_device_mesh", "all_gather", "all_reduce", "all_to_all",
    "broadcast", "reduce_scatter", "scatter", "collective_timeout", "set_collective_timeout",
    "all_to_all_uneven", "exchange_splits",
]
