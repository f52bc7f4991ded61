"""SDPA on sequence-sharded DTensors runs as ring attention, once turned on (torch's ``_enable_context_parallel_dispatcher``).

After :func:`enable_context_parallel_dispatcher`, ``F.scaled_dot_product_attention`` called with
DTensors that are ``Shard(seq)`` (dim ``-2``, ``[..., heads, seq, head_dim]``) on a 1-D mesh
computes exact attention over the whole sequence with :func:`ring_attention` over that mesh and
returns the output as a DTensor ``Shard(seq)``; every other call (plain tensors, other
placements) goes to torch's function unchanged. The sequence layout is the one the last
:func:`shardprop.parallel.cp.shard.context_parallel_shard_buffers` cut (torch keeps it as a
global option too): head-tail balanced, or contiguous without a balancer; an SDPA after a
sharding by another balancer (PTRR is for flex attention) raises.

torch swaps in its context-parallel SDPA handlers for the DTensor dispatcher's aten ops; here
the function itself is wrapped (torch's "monkey patch" mode) until
:func:`disable_context_parallel_dispatcher`: the gradient flows through ring attention's own
backward, and the wrapper is what ``F.scaled_dot_product_attention`` names while on.

Example:
    >>> enable_context_parallel_dispatcher()  # doctest: +SKIP
    >>> out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # q/k/v DTensors Shard(2)  # doctest: +SKIP
"""
from __future__ import annotations

import functools

import torch.nn.functional as F

from shardprop.parallel.cp import shard as _shard
from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.placement import Shard

__all__ = ["enable_context_parallel_dispatcher", "disable_context_parallel_dispatcher", "dispatcher_enabled"]

_original = {"sdpa": None}


def _seq_sharded(t) -> bool:
    return (isinstance(t, DTensor) and t.device_mesh.ndim == 1
            and tuple(t.placements) == (Shard(t.dim() - 2),))


def _cp_sdpa(original, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
    if not (_seq_sharded(query) and _seq_sharded(key) and _seq_sharded(value)):
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
    balanced = _shard.layout_is_head_tail()
    if balanced is None:
        raise NotImplementedError(
            f"context parallel SDPA: the sequence was sharded by {type(_shard.last_load_balancer()).__name__}; "
            "ring attention runs on a head-tail balanced (HeadTailLoadBalancer) or contiguous (no balancer) layout")
    if balanced and query.shape[-2] % (2 * query.device_mesh.size()):
        balanced = False  # torch's rule: head-tail only where the sequence divides into 2n chunks
    from shardprop.parallel.cp.context_parallel import _ContextParallelMode
    mode = _ContextParallelMode(query.device_mesh, balanced)
    return mode._sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def enable_context_parallel_dispatcher() -> None:
    """Route SDPA on DTensors ``Shard(seq)`` over a 1-D mesh to ring attention (module doc); idempotent.

    Example:
        >>> enable_context_parallel_dispatcher(); dispatcher_enabled()
        True
        >>> disable_context_parallel_dispatcher(); dispatcher_enabled()
        False
    """
    if _original["sdpa"] is not None:
        return
    original = F.scaled_dot_product_attention

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return _cp_sdpa(original, *args, **kwargs)

    _original["sdpa"] = original
    F.scaled_dot_product_attention = wrapper


def disable_context_parallel_dispatcher() -> None:
    """Put torch's ``F.scaled_dot_product_attention`` back (nothing if the dispatcher is off).

    Example:
        >>> disable_context_parallel_dispatcher(); dispatcher_enabled()
        False
    """
    if _original["sdpa"] is None:
        return
    F.scaled_dot_product_attention = _original["sdpa"]
    _original["sdpa"] = None


def dispatcher_enabled() -> bool:
    """Whether :func:`enable_context_parallel_dispatcher` is in effect.

    Example:
        >>> isinstance(dispatcher_enabled(), bool)
        True
    """
    return _original["sdpa"] is not None
