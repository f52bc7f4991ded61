"""shardprop: a from-scratch DTensor engine for PyTorch."""
from shardprop import config
from shardprop.tensor.placement import Partial, Placement, Replicate, Shard
from shardprop.tensor.spec import DTensorSpec, TensorMeta
from shardprop.mesh import DeviceMesh, init_device_mesh
from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.distribute import distribute_tensor
from shardprop.tensor.redistribute import plan_redistribute
from shardprop.dispatch import dispatcher as _dispatch  # noqa: F401  (installs DTensor's dispatcher)
from shardprop.checkpoint import pickling as _pickling  # noqa: F401  (pickle/deepcopy/torch.load of DTensors)
from shardprop.dispatch.propagate import ShardingError
from shardprop.dispatch.cache_control import clear_cache, set_cache_size, set_fallback_to_replicate
from shardprop.dispatch.registry import register_sharding, unregister_sharding
from shardprop.debug.stats import cache_stats, print_cache_stats
from shardprop.debug.explain import ImplicitRedistributionError, explain, explicit
from shardprop.debug.check_rule import RuleReport, check_sharding_rule
from shardprop.dispatch.decompose import set_decompose_fallback
import shardprop.ops  # noqa: F401,E402  (registers the built-in rules)
from shardprop.parallel.parallelize import distribute_module, parallelize_module  # noqa: E402
from shardprop.parallel.styles import ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel  # noqa: E402
from shardprop.parallel.loss_parallel import loss_parallel  # noqa: E402
from shardprop.mesh.collectives import CommCounter, comm_counter  # noqa: E402
from shardprop.mesh.buffer_pool import buffer_reuse_enabled, set_buffer_reuse  # noqa: E402
from shardprop.dispatch.random_ops import manual_seed  # noqa: E402  (also registers the random-op handlers)
from shardprop.parallel.data_parallel import GradientReducer, compute_bucket_assignment_by_size, replicate_gradients  # noqa: E402
from shardprop.parallel.fully_shard import FSDPModule, fully_shard  # noqa: E402  (FSDPModule lives in fsdp_module)
from shardprop.parallel.mixed_precision import MixedPrecisionPolicy  # noqa: E402
from shardprop.parallel.optim_foreach import set_optimizer_foreach_default  # noqa: E402  (registers the optimizer hooks)
from shardprop.checkpoint.full_state_dict import enable_full_state_dict_loading, full_state_dict, load_full_state_dict  # noqa: E402  (also attaches the DCP protocol and cross-mesh moves)
from shardprop.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict  # noqa: E402
from shardprop.parallel import parallelize as _parallelize  # noqa: E402
from shardprop.parallel.context_parallel import context_parallel, context_parallel_unshard  # noqa: E402

# A parallelized module's load_state_dict takes plain full tensors (parallel may not import checkpoint).
_parallelize.on_distributed.append(enable_full_state_dict_loading)

__all__ = [
    "distribute_module", "parallelize_module", "loss_parallel", "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput",
    "CommCounter", "comm_counter", "set_buffer_reuse", "buffer_reuse_enabled", "manual_seed", "GradientReducer", "compute_bucket_assignment_by_size", "replicate_gradients",
    "DTensor", "DTensorSpec", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "ShardingError",
    "ImplicitRedistributionError", "RuleReport", "TensorMeta", "check_sharding_rule", "cache_stats", "explain", "explicit", "clear_cache", "distribute_tensor", "init_device_mesh", "plan_redistribute",
    "print_cache_stats", "register_sharding", "set_cache_size", "set_decompose_fallback", "set_fallback_to_replicate",
    "unregister_sharding", "full_state_dict", "load_full_state_dict", "enable_full_state_dict_loading",
    "config", "get_optimizer_state_dict", "set_optimizer_state_dict", "fully_shard", "FSDPModule", "MixedPrecisionPolicy", "set_optimizer_foreach_default",
]

# FSDP2's remaining public names (torch.distributed.fsdp), beside fully_shard / FSDPModule / MixedPrecisionPolicy.
from shardprop.parallel.fsdp_api import CPUOffloadPolicy, GradientReductionHandle, OffloadPolicy, UnshardHandle  # noqa: E402
from shardprop.parallel.fsdp_module import register_fsdp_forward_method, share_comm_ctx  # noqa: E402
__all__ += ["OffloadPolicy", "CPUOffloadPolicy", "UnshardHandle", "GradientReductionHandle", "register_fsdp_forward_method",
            "share_comm_ctx"]
from shardprop.tensor.factories import empty, full, linspace, logspace, ones, rand, randn, zeros  # noqa: E402
__all__ += ["zeros", "ones", "empty", "full", "rand", "randn", "linspace", "logspace"]
from shardprop.parallel.local_map import local_map  # noqa: E402
from shardprop.dispatch.implicit import implicit_replication  # noqa: E402
from shardprop.parallel.prepare_io import PrepareModuleInputOutput  # noqa: E402
from shardprop import experimental  # noqa: E402,F401  (torch.distributed.tensor.experimental's names)
__all__ += ["local_map", "implicit_replication", "PrepareModuleInputOutput"]
__all__ += ["context_parallel", "context_parallel_unshard"]
from shardprop.dispatch.fast_paths import fast_paths, fast_paths_enabled, set_fast_paths  # noqa: E402
__all__ += ["fast_paths", "fast_paths_enabled", "set_fast_paths"]
from shardprop.parallel.ep import ExpertLoad, ExpertParallel, ExpertTensorParallel, expert_load  # noqa: E402
__all__ += ["ExpertParallel", "ExpertTensorParallel", "ExpertLoad", "expert_load"]
