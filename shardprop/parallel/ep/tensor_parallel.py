"""The tensor-parallel region of ExpertTensorParallel: experts' hidden dim sharded over tp.

Why two small autograd functions (Megatron's f and g): every tp rank of an ep group holds the
same routed tokens (replicated over tp) and computes its slice of each expert's hidden dim, so
its output is a partial sum over tp. ``copy_in`` is the identity forward and all-reduces the
input's gradient backward (each tp rank's gradient is the part through its hidden slice);
``reduce_out`` all-reduces the output forward and passes the gradient through backward.
Both go through ``collectives.all_reduce`` (counted, staged where needed; free on a tp dim of size 1).

Example:
    >>> h = reduce_out(experts(copy_in(tokens, mesh, "tp"), counts), mesh, "tp")  # doctest: +SKIP
"""
from __future__ import annotations

import torch

from shardprop.mesh import collectives


class _CopyIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, dim):
        ctx.mesh, ctx.dim = mesh, dim
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_reduce(grad, ctx.mesh, ctx.dim), None, None


class _ReduceOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, mesh, dim):
        return collectives.all_reduce(y, mesh, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def copy_in(x: torch.Tensor, mesh, dim) -> torch.Tensor:
    """``x`` (replicated over the tp dim ``dim``); its gradient is summed over tp in backward.

    Example:
        >>> tokens = copy_in(routed, mesh, "tp")  # doctest: +SKIP
    """
    return _CopyIn.apply(x, mesh, dim) if x.requires_grad and torch.is_grad_enabled() else x


def reduce_out(y: torch.Tensor, mesh, dim) -> torch.Tensor:
    """The sum over the tp dim ``dim`` of every rank's partial ``y`` (gradient passed through).

    Example:
        >>> out = reduce_out(partial_out, mesh, "tp")  # doctest: +SKIP
    """
    if y.requires_grad and torch.is_grad_enabled():
        return _ReduceOut.apply(y, mesh, dim)
    return collectives.all_reduce(y, mesh, dim)


__all__ = ["copy_in", "reduce_out"]
