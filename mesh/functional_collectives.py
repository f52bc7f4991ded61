"""Functional collectives over our meshes: torch's ``_functional_collectives`` names, taking a shardprop mesh.

Programs written for torch call ``funcol.all_reduce(x, "sum", group=mesh)`` with a device mesh as the
group (torchtitan's loss and gradient-norm helpers, its MoE token dispatcher). torch's own functions
accept only torch's mesh; these accept ours, as well as what torch's accept (a process group, a group
name, ``(mesh, dim)``). They issue torch's traceable ``_c10d_functional`` ops (so ``torch.compile``
records them, seed 003) and return the waited result, a plain tensor. ``shardprop.launch`` points a
program's ``torch.distributed._functional_collectives`` at this module.

Example:
    >>> from shardprop.mesh import functional_collectives as funcol
    >>> funcol.all_reduce(torch.ones(2), "sum", group=mesh)  # 4 ranks -> tensor([4., 4.])  # doctest: +SKIP
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from shardprop.mesh import compat

_F = torch.ops._c10d_functional
_F_AUTOGRAD = getattr(torch.ops, "_c10d_functional_autograd", None)


def _name_and_size(group):
    """(group name, group size) of what torch's functions accept as ``group``, or a shardprop mesh."""
    if isinstance(group, tuple) and len(group) == 2 and hasattr(group[0], "get_group"):
        group = group[0].get_group(group[1])
    elif hasattr(group, "get_group"):  # a device mesh
        if group.ndim != 1:
            raise ValueError(f"functional collective: a {group.ndim}-d mesh as the group; give (mesh, dim)")
        group = group.get_group(0)
    if isinstance(group, str):
        group = compat.group_by_name(group)
    if isinstance(group, dist.ProcessGroup):
        return group.group_name, group.size()
    raise TypeError(f"functional collective: group must be a device mesh, (mesh, dim), a ProcessGroup or a group "
                    f"name, got {type(group).__name__}")


def _op(reduce_op) -> str:
    return (getattr(reduce_op, "name", reduce_op) or "sum").lower()


def wait_tensor(t: torch.Tensor) -> torch.Tensor:
    """Wait for a collective's result (the functions here already wait: a no-op on their results).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> wait_tensor(all_reduce(torch.ones(2), "sum", mesh))
        tensor([4., 4.])
    """
    return _F.wait_tensor(t)


def all_reduce(self: torch.Tensor, reduceOp: str, group, tag: str = "") -> torch.Tensor:  # noqa: N803 (torch's name)
    """All-reduce ``self`` over ``group`` into a new tensor.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> all_reduce(torch.ones(2), "max", group=mesh)
        tensor([1., 1.])
    """
    name, _ = _name_and_size(group)
    return _F.wait_tensor(_F.all_reduce(self.contiguous(), _op(reduceOp), name))


def all_gather_tensor(self: torch.Tensor, gather_dim: int, group, tag: str = "") -> torch.Tensor:
    """Every rank's ``self`` concatenated along ``gather_dim``.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> all_gather_tensor(torch.ones(2, 3), 1, group=mesh).shape  # 4 ranks
        torch.Size([2, 12])
    """
    name, n = _name_and_size(group)
    out = _F.wait_tensor(_F.all_gather_into_tensor(self.contiguous(), n, name))
    if gather_dim % max(self.dim(), 1) != 0:
        out = torch.cat(torch.chunk(out, n, dim=0), dim=gather_dim)
    return out


def reduce_scatter_tensor(self: torch.Tensor, reduceOp: str, scatter_dim: int, group, tag: str = "") -> torch.Tensor:  # noqa: N803
    """Reduce ``self`` over ``group`` and keep this rank's piece along ``scatter_dim``.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> reduce_scatter_tensor(torch.ones(8), "sum", 0, group=mesh)  # 4 ranks
        tensor([4., 4.])
    """
    name, n = _name_and_size(group)
    if scatter_dim % max(self.dim(), 1) != 0:
        self = torch.cat(torch.chunk(self, n, dim=scatter_dim), dim=0)
    return _F.wait_tensor(_F.reduce_scatter_tensor(self.contiguous(), _op(reduceOp), n, name))


def _splits(t: torch.Tensor, sizes: Optional[List[int]], n: int) -> List[int]:
    if sizes is not None:
        return [int(s) for s in sizes]
    if t.shape[0] % n:
        raise ValueError(f"all_to_all_single: dim 0 ({t.shape[0]}) does not divide by the group size {n}; give split sizes")
    return [t.shape[0] // n] * n


def all_to_all_single(self: torch.Tensor, output_split_sizes: Optional[List[int]], input_split_sizes: Optional[List[int]],
                      group, tag: str = "") -> torch.Tensor:
    """Dim-0 slices of ``self`` to every rank (``input_split_sizes``), theirs back (``output_split_sizes``).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> all_to_all_single(torch.full((4,), float(dist.get_rank())), None, None, group=mesh)
        tensor([0., 1., 2., 3.])
    """
    name, n = _name_and_size(group)
    out = _F.all_to_all_single(self.contiguous(), _splits(self, output_split_sizes, n),
                               _splits(self, input_split_sizes, n), name)
    return _F.wait_tensor(out)


def all_to_all_single_autograd(self: torch.Tensor, output_split_sizes, input_split_sizes, group,
                               tag: str = "") -> torch.Tensor:
    """:func:`all_to_all_single` with a backward (the reverse exchange).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> x = torch.full((4,), float(dist.get_rank()), requires_grad=True)
        >>> y = all_to_all_single_autograd(x, [1, 1, 1, 1], [1, 1, 1, 1], group=mesh)
        >>> y.detach()
        tensor([0., 1., 2., 3.])
        >>> y.sum().backward(); x.grad
        tensor([1., 1., 1., 1.])
    """
    if _F_AUTOGRAD is None:
        raise NotImplementedError("all_to_all_single_autograd: this torch has no _c10d_functional_autograd ops")
    name, n = _name_and_size(group)
    out = _F_AUTOGRAD.all_to_all_single(self.contiguous(), _splits(self, output_split_sizes, n),
                                        _splits(self, input_split_sizes, n), name)
    return _F.wait_tensor(out)


def broadcast(self: torch.Tensor, src: int, group, tag: str = "") -> torch.Tensor:
    """``self`` of global rank ``src`` on every rank of ``group``.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> broadcast(torch.full((2,), float(dist.get_rank())), 0, group=mesh)
        tensor([0., 0.])
    """
    name, _ = _name_and_size(group)
    return _F.wait_tensor(_F.broadcast(self.contiguous(), src, name))


__all__ = ["all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single",
           "all_to_all_single_autograd", "broadcast", "wait_tensor"]
