"""``flex_cp_allgather``: all-gather sequence-sharded keys and values for flex attention, reduce-scatter their gradients.

Context parallelism for flex attention (torchtitan's): each rank keeps its queries, gathers every
rank's keys and values along ``seq_dim`` (in rank order, i.e. the load-balanced sequence order
the ranks were cut from) and attends them through a BlockMask sharded by
:func:`shardprop.parallel.cp.shard.shard_block_mask`. Backward, the gradients of the gathered
keys/values are summed over the ranks and each rank keeps its own piece (a reduce-scatter).

The group comes by its registered name (``dist._get_process_group_name(group)``, as torchtitan
passes it), resolved with :func:`shardprop.mesh.compat.group_by_name`. The gather is a
``torch.library`` custom op (``shardprop::flex_cp_allgather``, with a fake implementation and its
autograd formula), so torch.compile keeps it as one opaque call, as torch's
``cplib::flex_cp_allgather``.

Example:
    >>> k_all, v_all = flex_cp_allgather(k, v, 1, dist._get_process_group_name(cp_group))  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from shardprop.mesh import collectives, compat

__all__ = ["flex_cp_allgather", "mesh_of_group"]

_meshes: Dict[Tuple[str, str], object] = {}


def mesh_of_group(pg_name: str, device_type: str):
    """A 1-D mesh over the process group registered as ``pg_name`` (made once per name and device type).

    Example:
        >>> mesh_of_group(dist.group.WORLD.group_name, "cpu").size()  # doctest: +SKIP
        4
    """
    key = (pg_name, device_type)
    if key not in _meshes:
        from shardprop.mesh.device_mesh import DeviceMesh
        _meshes[key] = DeviceMesh.from_group(compat.group_by_name(pg_name), device_type)
    return _meshes[key]


def _group_size(pg_name: str) -> int:
    return compat.group_by_name(pg_name).size()


def _gather(t: torch.Tensor, seq_dim: int, mesh) -> torch.Tensor:
    front = t.movedim(seq_dim, 0).contiguous()
    return collectives.all_gather(front, mesh, 0, pooled=False).movedim(0, seq_dim).contiguous()


def _reduce_scatter(t: torch.Tensor, seq_dim: int, mesh) -> torch.Tensor:
    front = t.movedim(seq_dim, 0).contiguous()
    return collectives.reduce_scatter(front, mesh, 0, "sum").movedim(0, seq_dim).contiguous()


def _resized(t: torch.Tensor, seq_dim: int, times: int = 1, over: int = 1) -> torch.Tensor:
    """An empty tensor like ``t`` with ``seq_dim`` ``times`` as long, or ``over`` times shorter (fake results)."""
    shape = list(t.shape)
    shape[seq_dim] = shape[seq_dim] * times // over
    return t.new_empty(shape)


@torch.library.custom_op("shardprop::flex_cp_allgather", mutates_args=())
def _allgather_op(k: torch.Tensor, v: torch.Tensor, seq_dim: int, pg_name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    mesh = mesh_of_group(pg_name, k.device.type)
    return _gather(k, seq_dim, mesh), _gather(v, seq_dim, mesh)


@_allgather_op.register_fake
def _(k, v, seq_dim, pg_name):
    n = _group_size(pg_name)
    return _resized(k, seq_dim, times=n), _resized(v, seq_dim, times=n)


@torch.library.custom_op("shardprop::flex_cp_allgather_backward", mutates_args=())
def _allgather_backward_op(grad_k: torch.Tensor, grad_v: torch.Tensor, seq_dim: int,
                           pg_name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    mesh = mesh_of_group(pg_name, grad_k.device.type)
    return _reduce_scatter(grad_k, seq_dim, mesh), _reduce_scatter(grad_v, seq_dim, mesh)


@_allgather_backward_op.register_fake
def _(grad_k, grad_v, seq_dim, pg_name):
    n = _group_size(pg_name)
    return _resized(grad_k, seq_dim, over=n), _resized(grad_v, seq_dim, over=n)


def _setup(ctx, inputs, output) -> None:
    ctx.seq_dim, ctx.pg_name = inputs[2], inputs[3]


def _backward(ctx, grad_k, grad_v):
    gk, gv = _allgather_backward_op(grad_k.contiguous(), grad_v.contiguous(), ctx.seq_dim, ctx.pg_name)
    return gk, gv, None, None


_allgather_op.register_autograd(_backward, setup_context=_setup)


def flex_cp_allgather(k: torch.Tensor, v: torch.Tensor, seq_dim: int, pg_name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``k`` and ``v`` concatenated along ``seq_dim`` in rank order (differentiable: see module doc).

    Example:
        >>> k_all, v_all = flex_cp_allgather(k, v, 1, dist._get_process_group_name(cp_group))  # doctest: +SKIP
        >>> k_all.shape[1] == k.shape[1] * cp_group.size()  # doctest: +SKIP
        True
    """
    return _allgather_op(k.contiguous(), v.contiguous(), seq_dim, pg_name)
