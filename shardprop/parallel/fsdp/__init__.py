"""Fully sharded data parallelism: ``fully_shard`` (FSDP2's API), its units, hooks, flat buffers and mixed precision.

Example:
    >>> from shardprop.parallel.fsdp import DataParallelMeshDims, fully_shard
    >>> fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))  # doctest: +SKIP
"""
from shardprop.parallel.fsdp.api import (
    CPUOffloadPolicy, DataParallelMeshDims, GradientReductionHandle, OffloadPolicy, UnshardHandle)
from shardprop.parallel.fsdp.fully_shard import FSDPModule, fully_shard
from shardprop.parallel.fsdp.mesh_info import (
    DataParallelMeshInfo, DDPMeshInfo, FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult, _get_mesh_info, get_mesh_info)
from shardprop.parallel.fsdp.mixed_precision import MixedPrecisionPolicy
from shardprop.parallel.fsdp.module import register_fsdp_forward_method, share_comm_ctx

__all__ = ["fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "UnshardHandle",
           "GradientReductionHandle", "register_fsdp_forward_method", "share_comm_ctx", "DataParallelMeshDims",
           "DataParallelMeshInfo", "DDPMeshInfo", "FSDPMeshInfo", "HSDPMeshInfo", "ShardPlacementResult",
           "get_mesh_info", "_get_mesh_info"]
