"""shardprop: a from-scratch DTensor engine for PyTorch."""
from shardprop.placement import Partial, Placement, Replicate, Shard
from shardprop.spec import DTensorSpec, TensorMeta
from shardprop.mesh import DeviceMesh, init_device_mesh
from shardprop.dtensor import DTensor
from shardprop.api import distribute_tensor
from shardprop.redistribute import plan_redistribute
from shardprop import dispatch as _dispatch  # noqa: F401  (installs DTensor's dispatcher)
from shardprop.propagate import ShardingError, clear_cache, set_cache_size, set_fallback_to_replicate
from shardprop.registry import register_sharding, unregister_sharding
from shardprop.stats import cache_stats, print_cache_stats
from shardprop.explain import ImplicitRedistributionError, explain, explicit
from shardprop.check import RuleReport, check_sharding_rule
import shardprop.ops  # noqa: F401,E402  (registers the built-in rules)

__all__ = [
    "DTensor", "DTensorSpec", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "ShardingError",
    "ImplicitRedistributionError", "RuleReport", "TensorMeta", "check_sharding_rule", "cache_stats", "explain", "explicit", "clear_cache", "distribute_tensor", "init_device_mesh", "plan_redistribute",
    "print_cache_stats", "register_sharding", "set_cache_size", "set_fallback_to_replicate",
    "unregister_sharding",
]
