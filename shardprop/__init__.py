"""shardprop: a from-scratch DTensor engine for PyTorch.

This module only re-exports the public names. What importing shardprop sets up (DTensor's methods
from the rooms above its own, the built-in sharding rules, the hooks between rooms) is listed in
``shardprop/assembly.py``; the order of the imports below carries no meaning.
"""
from shardprop import assembly as _assembly  # noqa: F401  (the rooms wired together: see its docstring)
from shardprop import config, experimental  # noqa: F401
from shardprop.checkpoint.full_state_dict import enable_full_state_dict_loading, full_state_dict, load_full_state_dict
from shardprop.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from shardprop.debug.check_rule import RuleReport, check_sharding_rule
from shardprop.debug.explain import ImplicitRedistributionError, explain, explicit
from shardprop.debug.stats import cache_stats, print_cache_stats
from shardprop.dispatch.cache_control import clear_cache, set_cache_size, set_fallback_to_replicate
from shardprop.dispatch.decompose import set_decompose_fallback
from shardprop.dispatch.fast_paths import fast_paths, fast_paths_enabled, set_fast_paths
from shardprop.dispatch.implicit import implicit_replication
from shardprop.dispatch.propagate import ShardingError
from shardprop.dispatch.random_ops import manual_seed
from shardprop.dispatch.registry import register_sharding, unregister_sharding
from shardprop.mesh import DeviceMesh, init_device_mesh
from shardprop.mesh.transport.buffer_pool import buffer_reuse_enabled, set_buffer_reuse
from shardprop.mesh.collectives import CommCounter, comm_counter
from shardprop.parallel.cp.context_parallel import context_parallel, context_parallel_unshard
from shardprop.parallel.dp.data_parallel import GradientReducer, compute_bucket_assignment_by_size, replicate_gradients
from shardprop.parallel.ep import ExpertLoad, ExpertParallel, ExpertTensorParallel, expert_load
from shardprop.parallel.ep.hf_experts import HFExperts
from shardprop.parallel.fsdp.api import (
    CPUOffloadPolicy, DataParallelMeshDims, GradientReductionHandle, OffloadPolicy, UnshardHandle)
from shardprop.parallel.fsdp.module import register_fsdp_forward_method, share_comm_ctx
from shardprop.parallel.fsdp.fully_shard import FSDPModule, fully_shard
from shardprop.parallel.local_map import local_map
from shardprop.parallel.tp.loss_parallel import loss_parallel
from shardprop.parallel.fsdp.mixed_precision import MixedPrecisionPolicy
from shardprop.parallel.hf_plans import parallelize_hf
from shardprop.parallel.fast.optim_foreach import set_optimizer_foreach_default
from shardprop.parallel.tp.parallelize import distribute_module, parallelize_module
from shardprop.parallel.tp.prepare_io import PrepareModuleInputOutput
from shardprop.planner import CostModel, NoPlanFits, Plan, autoplan, calibrate
from shardprop.parallel.tp.styles import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel)
from shardprop.tensor.distribute import distribute_tensor
from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.factories import empty, full, linspace, logspace, ones, rand, randn, zeros
from shardprop.tensor.placement import Partial, Placement, Replicate, Shard, _StridedShard
from shardprop.tensor.redistribute import plan_redistribute
from shardprop.tensor.spec import DTensorSpec, TensorMeta

__all__ = [
    "distribute_module", "parallelize_module", "loss_parallel", "ParallelStyle", "ColwiseParallel", "RowwiseParallel",
    "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput",
    "CommCounter", "comm_counter", "set_buffer_reuse", "buffer_reuse_enabled", "manual_seed", "GradientReducer",
    "compute_bucket_assignment_by_size", "replicate_gradients",
    "DTensor", "DTensorSpec", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "_StridedShard", "ShardingError",
    "ImplicitRedistributionError", "RuleReport", "TensorMeta", "check_sharding_rule", "cache_stats", "explain",
    "explicit", "clear_cache", "distribute_tensor", "init_device_mesh", "plan_redistribute",
    "print_cache_stats", "register_sharding", "set_cache_size", "set_decompose_fallback", "set_fallback_to_replicate",
    "unregister_sharding", "full_state_dict", "load_full_state_dict", "enable_full_state_dict_loading",
    "config", "get_optimizer_state_dict", "set_optimizer_state_dict", "fully_shard", "FSDPModule",
    "MixedPrecisionPolicy", "set_optimizer_foreach_default",
    # FSDP2's remaining public names (torch.distributed.fsdp), beside fully_shard / FSDPModule / MixedPrecisionPolicy.
    "OffloadPolicy", "CPUOffloadPolicy", "UnshardHandle", "GradientReductionHandle", "register_fsdp_forward_method",
    "share_comm_ctx", "DataParallelMeshDims",
    "zeros", "ones", "empty", "full", "rand", "randn", "linspace", "logspace",
    "local_map", "implicit_replication", "PrepareModuleInputOutput",
    "context_parallel", "context_parallel_unshard",
    "fast_paths", "fast_paths_enabled", "set_fast_paths",
    "ExpertParallel", "ExpertTensorParallel", "ExpertLoad", "expert_load",
    "HFExperts", "parallelize_hf",
    # automatic plans (shardprop.planner): docs/guides/autoplan.md
    "autoplan", "calibrate", "Plan", "NoPlanFits", "CostModel",
]
