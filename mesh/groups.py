"""Process groups: default-group start-up, timeouts, and one cache of sub-groups.

Communicator creation is expensive and collective (every rank must take part, in
the same order), so groups are created once, eagerly, when a mesh is built, and
kept in a cache keyed by their rank list. Later meshes over the same ranks reuse
them; nothing creates a group lazily inside a collective call.
"""
from __future__ import annotations

import datetime
import os
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from shardprop.mesh import compat, config
from shardprop.mesh.config import values as _settings


# (backend, ranks) -> ProcessGroup, or None on ranks outside the group.
_group_cache: Dict[Tuple[str, Tuple[int, ...]], Optional[dist.ProcessGroup]] = {}


def set_collective_timeout(seconds: float) -> None:
    """Set the timeout of process groups created from now on.

    A collective that a peer never joins (it died, or diverged) fails after this
    long instead of hanging.

    Example:
        >>> set_collective_timeout(30)
    """
    config.set("collective_timeout", seconds)


def collective_timeout() -> datetime.timedelta:
    """The timeout given to new process groups and to explicit waits.

    Example:
        >>> collective_timeout().total_seconds() > 0
        True
    """
    return datetime.timedelta(seconds=_settings.collective_timeout)


def backend_for(device_type: str) -> str:
    """The c10d backend we use for a device type: NCCL on CUDA, gloo otherwise.

    A CUDA mesh in a world whose default group has no NCCL (``init_process_group("gloo")``, as
    for several ranks sharing one GPU: NCCL refuses two ranks on one device) gets gloo groups;
    collectives then stage what gloo cannot carry on the GPU through host memory (mesh/transport/staging.py).

    Example:
        >>> backend_for("cpu")
        'gloo'
    """
    if device_type != "cuda":
        return "gloo"
    if dist.is_initialized() and "nccl" not in str(dist.get_backend()).lower():
        return "gloo"
    return "nccl"


def check_nccl_devices(world_per_host: int, devices: int) -> None:
    """Raise a clear error when ranks on one host outnumber its GPUs for NCCL (which refuses shared GPUs).

    Example:
        >>> check_nccl_devices(4, 8)
        >>> check_nccl_devices(4, 1)  # doctest: +SKIP
        RuntimeError: shardprop: 4 ranks per host on 1 CUDA device(s) ...
    """
    if devices < 1:
        raise RuntimeError("shardprop: a CUDA mesh needs a CUDA device, and torch.cuda.device_count() is 0 "
                           "(use device_type 'cpu', or a CUDA build of torch on a machine with a GPU)")
    if world_per_host > devices:
        raise RuntimeError(
            f"shardprop: {world_per_host} ranks per host on {devices} CUDA device(s): NCCL needs one GPU per rank "
            "(it fails with 'Duplicate GPU detected'). Start the default group with gloo instead "
            "(ensure_default_group('cuda', backend='gloo') or init_process_group('gloo')): the ranks then share "
            "the GPUs, CUDA tensors travel over gloo, point-to-point moves staged through host memory.")


def ensure_default_group(device_type: str, backend: Optional[str] = None) -> None:
    """Initialise the default process group from the environment if needed.

    Reuses an existing default group. On CUDA the group is initialised eagerly
    with ``device_id`` so sub-groups can be split from its communicator.
    ``backend="gloo"`` on CUDA: ranks may share GPUs (see :func:`backend_for`).

    Example:
        >>> ensure_default_group("cpu")  # doctest: +SKIP
    """
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            "shardprop: the default process group is not initialised and the environment "
            f"lacks {missing}; launch with torchrun or call torch.distributed.init_process_group first"
        )
    kwargs = {}
    backend = backend or backend_for(device_type)
    if device_type == "cuda":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        check_nccl_devices(local_world if backend == "nccl" else 1, torch.cuda.device_count())
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend=backend, timeout=collective_timeout(), **kwargs)


def create_groups(all_rank_lists: Iterable[Sequence[int]], backend: str) -> Optional[dist.ProcessGroup]:
    """Create (or reuse) one group per rank list; return the one holding this rank.

    Every rank must call this with the same lists in the same order: group
    creation is collective over the default group. On NCCL the lists (one
    partition of the ranks) are split from the default communicator in one call.

    Example:
        >>> create_groups([[0, 1], [2, 3]], "gloo")  # doctest: +SKIP
    """
    me = dist.get_rank()
    keys = [(backend, tuple(int(r) for r in ranks)) for ranks in all_rank_lists]
    todo = [k for k in keys if k not in _group_cache]
    if todo and backend == "nccl" and compat.split_group is not None:
        split = compat.split_group(split_ranks=[list(k[1]) for k in todo], timeout=collective_timeout())
        for k in todo:
            _group_cache[k] = split if me in k[1] else None
    else:
        for k in todo:
            _group_cache[k] = dist.new_group(list(k[1]), timeout=collective_timeout(), backend=backend)
    for k in keys:
        if me in k[1]:
            return _group_cache[k]
    return None
