"""shardprop: a from-scratch DTensor engine for PyTorch."""
from shardprop.placement import Partial, Placement, Replicate, Shard
from shardprop.spec import DTensorSpec, TensorMeta
from shardprop.mesh import DeviceMesh, init_device_mesh
from shardprop.dtensor import DTensor
from shardprop.api import distribute_tensor
from shardprop.redistribute import plan_redistribute

__all__ = [
    "DTensor", "DTensorSpec", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "TensorMeta",
    "distribute_tensor", "init_device_mesh", "plan_redistribute",
]
