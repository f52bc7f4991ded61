"""Full (unsharded) state dicts: gather a parallelized model into one, and load one into it.

- :func:`full_state_dict` gathers entry by entry: each rank sends rank 0 the pieces only it
  would send (one replica per box, point-to-point, the cross-mesh move to "rank 0 alone"),
  so a rank never holds more than one full entry at a time besides what it returns.
- Loading: a parallelized module accepts plain full tensors in ``load_state_dict``: a
  ``load_state_dict`` pre-hook (installed by ``parallelize_module``/``distribute_module``, or by
  :func:`enable_full_state_dict_loading`) distributes each plain entry to its parameter's mesh and
  placements, one entry at a time. ``src_data_rank`` is the global rank whose values every rank
  gets (default 0; over a mesh of all ranks it is scattered as ``distribute_tensor`` does, over a
  mesh of some ranks it is broadcast, then cut); ``None``: each rank cuts its own copy.
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardprop.checkpoint.cross_mesh import RankList, move_local
from shardprop.tensor.distribute import distribute_tensor
from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.placement import Replicate

_SRC_ATTR = "_shardprop_full_sd_src"  # module attribute: src_data_rank of its installed hook


def full_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True) -> Dict[str, Any]:
    """``model.state_dict()`` with every DTensor replaced by its full tensor (plain tensors).

    Collective: every rank calls it. With ``rank0_only`` (default) global rank 0 gets the dict
    and the others an empty one (rank 0 gathers from the ranks of its own meshes; replicas on
    meshes without rank 0, e.g. other dp groups, send nothing); otherwise every rank gets it. ``cpu_offload`` moves each
    entry to CPU as it is gathered. A single-device model of the same architecture loads the
    result with ``load_state_dict`` (Hugging Face ``save_pretrained`` style).

    Example:
        >>> _ = torch.manual_seed(0); plain_model = nn.Linear(8, 8)
        >>> tp_model = parallelize_module(nn.Linear(8, 8), init_device_mesh("cpu", (4,)), ColwiseParallel())
        >>> sd = full_state_dict(tp_model)                          # plain full tensors, on rank 0
        >>> if dist.get_rank() == 0: plain_model.load_state_dict(sd)
        <All keys matched successfully>
        >>> sorted(sd), sd["weight"].shape if sd else None    # rank 0; the others get an empty dict
        (['bias', 'weight'], torch.Size([8, 8]))
    """
    me = dist.get_rank()
    out: Dict[str, Any] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = _gather(value, rank0_only)
            if value is None:
                continue
        elif rank0_only and me != 0:
            continue
        if cpu_offload and isinstance(value, torch.Tensor):
            value = value.cpu()
        out[key] = value
    return out


def _gather(dt: DTensor, rank0_only: bool) -> Optional[torch.Tensor]:
    spec = dt._spec
    if not rank0_only:
        if spec.mesh._coord is None:
            raise RuntimeError(f"full_state_dict(rank0_only=False): rank {dist.get_rank()} is not in {spec.mesh}")
        return dt.redistribute(placements=[Replicate()] * spec.mesh.ndim).to_local().detach()
    if 0 not in spec.mesh._flat:
        return None  # a replica on another mesh (e.g. another dp group's tp mesh): rank 0 reads its own
    target = RankList.of([0], spec.mesh.device_type)
    local = move_local(dt._local_tensor.detach(), spec, target, (Replicate(),))
    return local if target._coord is not None else None


def _load_pre_hook(module: nn.Module, state_dict, prefix, local_metadata, strict, missing_keys,
                   unexpected_keys, error_msgs) -> None:
    """``load_state_dict`` pre-hook: plain entries for DTensor parameters/buffers become DTensors."""
    src = getattr(module, _SRC_ATTR, 0)
    named = itertools.chain(module.named_parameters(remove_duplicate=False),
                            module.named_buffers(remove_duplicate=False))
    for name, target in named:
        key = prefix + name
        value = state_dict.get(key)
        if not isinstance(target, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            continue
        if tuple(value.shape) != tuple(target.shape):
            continue  # load_state_dict reports the size mismatch with the key's name
        state_dict[key] = _distribute_entry(value, target, src)


def _distribute_entry(value: torch.Tensor, target: DTensor, src: Optional[int]) -> DTensor:
    """``value`` (global rank ``src``'s, or each rank's own if None) laid out like ``target``."""
    mesh = target.device_mesh
    if value.is_meta:  # a placeholder on ranks whose data is not used
        value = torch.empty(value.shape, dtype=value.dtype)
    if src is not None and mesh.size() != dist.get_world_size():
        # The mesh is one of several (e.g. a tp mesh per dp group): the source may not be in it, so
        # take its value over the whole world, then cut locally. One entry at a time.
        if dist.get_rank() == src:
            value = value.to(_device(mesh)).contiguous()
        else:  # a fresh buffer: never write into the caller's tensor
            value = torch.empty(value.shape, dtype=value.dtype, device=_device(mesh))
        dist.broadcast(value, src)
        src = None
    if mesh._coord is None:
        return value  # not ours to hold
    if src is not None:
        src = mesh._flat.index(src)  # distribute_tensor counts in mesh order
    return distribute_tensor(value, mesh, target.placements, src_data_rank=src)


def _device(mesh) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")


def enable_full_state_dict_loading(module: nn.Module, *, src_data_rank: Optional[int] = 0) -> nn.Module:
    """Let ``module.load_state_dict`` take plain full tensors for its DTensor parameters and buffers.

    Each plain entry is distributed to its parameter's mesh and placements as it is loaded
    (bounded memory: one entry at a time). ``src_data_rank``: the global rank whose data every
    rank gets (the others may pass tensors of the right shape, even on the meta device);
    ``None``: every rank cuts its shard from its own copy, with no communication. Collective:
    every rank calls ``load_state_dict``. Installed once per module (calling again updates ``src_data_rank``);
    ``parallelize_module`` and ``distribute_module`` install it.

    Example:
        >>> _ = torch.manual_seed(0); plain_model = nn.Linear(8, 8)
        >>> tp_model = parallelize_module(nn.Linear(8, 8), init_device_mesh("cpu", (4,)), ColwiseParallel())
        >>> tp_model = enable_full_state_dict_loading(tp_model)
        >>> tp_model.load_state_dict(plain_model.state_dict())
        <All keys matched successfully>
        >>> torch.equal(tp_model.weight.full_tensor(), plain_model.weight.detach())
        True
    """
    first = not hasattr(module, _SRC_ATTR)
    setattr(module, _SRC_ATTR, src_data_rank)
    if first:
        module.register_load_state_dict_pre_hook(_load_pre_hook)
    return module


def load_full_state_dict(model: nn.Module, state_dict: Optional[Dict[str, Any]], *, src_data_rank: Optional[int] = 0,
                         strict: bool = True):
    """Load a plain full state dict into a parallelized ``model`` (collective).

    Only the source rank's values matter; on other ranks ``state_dict`` may be ``None`` (every
    entry is then a meta-device placeholder of the model's own shape and dtype, so no memory is
    spent on data that is never read). Returns what ``load_state_dict`` returns.

    Example:
        >>> _ = torch.manual_seed(0); plain_sd = nn.Linear(8, 8).state_dict()
        >>> tp_model = parallelize_module(nn.Linear(8, 8), init_device_mesh("cpu", (4,)), ColwiseParallel())
        >>> load_full_state_dict(tp_model, plain_sd if dist.get_rank() == 0 else None)
        <All keys matched successfully>
        >>> torch.equal(tp_model.weight.full_tensor(), plain_sd["weight"])
        True
    """
    enable_full_state_dict_loading(model, src_data_rank=src_data_rank)
    if state_dict is None:
        if src_data_rank is None:
            raise ValueError("load_full_state_dict: with src_data_rank=None every rank must pass the state dict")
        # Plain (non-DTensor) entries keep this rank's own value.
        state_dict = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, DTensor) else v
                      for k, v in model.state_dict().items()}
    return model.load_state_dict(state_dict, strict=strict)
