"""What a program's imports of torch's DTensor stack resolve to under ``shardprop.launch``: one table.

Each torch module a program may import (``torch.distributed.tensor``, its submodules,
``torch.distributed.device_mesh``, ``torch.distributed.fsdp``, ``torch.distributed._functional_collectives``,
``torch.distributed._tensor``) maps to the names shardprop gives in its place, each named as
``"module:attribute"`` and imported on first use. A name listed as :data:`NOT_PROVIDED` imports
(programs import torch-private helpers at module level for paths they may never take) as a class that
raises, naming itself, when called, and that nothing is an instance of. A name not in the table does not import: ``ImportError`` says which
name of which module shardprop lacks, rather than mixing torch's engine with ours.

Example:
    >>> resolve("torch.distributed.tensor", "Shard") is __import__("shardprop").Shard
    True
"""
from __future__ import annotations

import importlib
from typing import Dict

NOT_PROVIDED = "-"  # the table's mark for a name a program may import but shardprop does not give

_TENSOR = {
    **{n: f"shardprop:{n}" for n in (
        "DTensor", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "distribute_module", "distribute_tensor",
        "init_device_mesh", "zeros", "ones", "empty", "full", "rand", "randn")},
}
_PLACEMENT_TYPES = {n: f"shardprop:{n}" for n in ("Placement", "Replicate", "Shard", "Partial")}
_PARALLEL = {n: f"shardprop:{n}" for n in (
    "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
    "PrepareModuleOutput", "PrepareModuleInputOutput", "parallelize_module", "loss_parallel")}
_EXPERIMENTAL = {
    "local_map": "shardprop:local_map", "context_parallel": "shardprop:context_parallel",
    "implicit_replication": "shardprop:implicit_replication", "register_sharding": "shardprop:register_sharding",
}
_FSDP = {n: f"shardprop:{n}" for n in (
    "fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "UnshardHandle",
    "register_fsdp_forward_method")}
_FUNCOL = {n: f"shardprop.mesh.functional_collectives:{n}" for n in (
    "all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_to_all_single_autograd",
    "broadcast", "wait_tensor")}
_CP = "shardprop.parallel.cp"
_CP_PRIVATE = {
    "_LoadBalancer": f"{_CP}.load_balance:LoadBalancer",
    "_HeadTailLoadBalancer": f"{_CP}.load_balance:HeadTailLoadBalancer",
    "_PerDocumentHeadTailLoadBalancer": f"{_CP}.load_balance:PerDocumentHeadTailLoadBalancer",
    "_PTRRLoadBalancer": f"{_CP}.load_balance:PTRRLoadBalancer",
    "_context_parallel_shard": f"{_CP}.shard:context_parallel_shard_buffers",
    "_enable_context_parallel_dispatcher": f"{_CP}.dispatcher:enable_context_parallel_dispatcher",
    "_disable_context_parallel_dispatcher": f"{_CP}.dispatcher:disable_context_parallel_dispatcher",
    "flex_cp_allgather": f"{_CP}.flex:flex_cp_allgather",
    "context_parallel": "shardprop:context_parallel",
}
_DEVICE_MESH = {"DeviceMesh": "shardprop:DeviceMesh", "init_device_mesh": "shardprop:init_device_mesh"}

# torch module -> {name: "our_module:attribute" or NOT_PROVIDED}
TABLE: Dict[str, Dict[str, str]] = {
    "torch.distributed.tensor": _TENSOR,
    "torch.distributed._tensor": _TENSOR,
    "torch.distributed.tensor.placement_types": {**_PLACEMENT_TYPES, "_StridedShard": "shardprop:_StridedShard"},
    "torch.distributed._tensor.placement_types": {**_PLACEMENT_TYPES, "_StridedShard": "shardprop:_StridedShard"},
    "torch.distributed.tensor.parallel": _PARALLEL,
    "torch.distributed.tensor.experimental": _EXPERIMENTAL,
    # torch's private context-parallel helpers (torchtitan's context-parallel module imports them)
    "torch.distributed.tensor.experimental._attention": _CP_PRIVATE,
    "torch.distributed.tensor.experimental._context_parallel": _CP_PRIVATE,
    "torch.distributed.tensor.experimental._context_parallel._attention": _CP_PRIVATE,
    # torch's manual_seed does not check that ranks agree (trainers seed each pipeline stage differently)
    "torch.distributed.tensor._random": {"manual_seed": "shardprop.dispatch.random_ops:manual_seed_as_torch"},
    "torch.distributed.device_mesh": _DEVICE_MESH,
    "torch.distributed.fsdp": {**_FSDP, "DataParallelMeshDims": "shardprop.parallel.fsdp:DataParallelMeshDims"},
    "torch.distributed._composable.fsdp": _FSDP,
    "torch.distributed._composable.fsdp.fully_shard": _FSDP,
    "torch.distributed.fsdp._fully_shard._fsdp_common": {n: f"shardprop.parallel.fsdp:{n}" for n in (
        "FSDPMeshInfo", "HSDPMeshInfo", "DDPMeshInfo", "DataParallelMeshInfo", "ShardPlacementResult")},
    "torch.distributed.fsdp._fully_shard._fsdp_init": {"_get_mesh_info": "shardprop.parallel.fsdp:_get_mesh_info"},
    "torch.distributed._functional_collectives": _FUNCOL,
}


def not_provided(module: str, name: str) -> type:
    """A stand-in for a torch name shardprop does not give: importing it works, calling or instantiating it
    raises, naming it, and ``isinstance(x, it)`` is False for everything (no shardprop object is one).

    Example:
        >>> rotate = not_provided("torch.distributed.tensor.experimental._attention", "_RotateMethod")
        >>> isinstance(object(), rotate)
        False
        >>> rotate()
        Traceback (most recent call last):
        ...
        NotImplementedError: shardprop does not provide torch.distributed.tensor.experimental._attention._RotateMethod (imported through shardprop.launch); the program used it
    """
    where = f"{module}.{name}"

    def refuse(cls, *args, **kwargs):
        raise NotImplementedError(f"shardprop does not provide {where} (imported through shardprop.launch); "
                                  "the program used it")

    return type(name, (), {"__new__": refuse, "__module__": __name__, "__doc__": f"not provided by shardprop: {where}"})


def resolve(module: str, name: str):
    """Our object for ``module.name`` (:func:`not_provided`'s class for a listed gap); AttributeError if unlisted.

    Example:
        >>> resolve("torch.distributed.fsdp", "fully_shard").__module__
        'shardprop.parallel.fsdp.fully_shard'
    """
    where = TABLE.get(module, {}).get(name)
    if where is None:
        raise AttributeError(f"shardprop's stand-in for {module} has no {name!r}: shardprop does not provide it "
                             f"(see shardprop.interop.torch_names)")
    if where == NOT_PROVIDED:
        return _NOT_PROVIDED.setdefault((module, name), not_provided(module, name))
    mod, attr = where.split(":")
    return getattr(importlib.import_module(mod), attr)


def describe() -> str:
    """The table as text: each redirected torch module and the names it gives (``python -m shardprop.launch --list``).

    Example:
        >>> print(describe().splitlines()[0])
        torch.distributed._composable.fsdp -> shardprop
    """
    lines = []
    for module in sorted(TABLE):
        names = TABLE[module]
        ours = sorted({w.split(":")[0] for w in names.values() if w != NOT_PROVIDED})
        lines.append(f"{module} -> {', '.join(ours) or '(placeholders only)'}")
        given = sorted(n for n, w in names.items() if w != NOT_PROVIDED)
        missing = sorted(n for n, w in names.items() if w == NOT_PROVIDED)
        if given:
            lines.append(f"    gives: {', '.join(given)}")
        if missing:
            lines.append(f"    imports but raises when used: {', '.join(missing)}")
    return "\n".join(lines)


_NOT_PROVIDED: Dict[tuple, type] = {}  # one stand-in class per name, so isinstance checks see one class

__all__ = ["TABLE", "NOT_PROVIDED", "not_provided", "resolve", "describe"]
