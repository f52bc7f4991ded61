"""Cut buffers and flex-attention BlockMasks to this rank's part of the sequence, with a load balancer.

torch's ``_context_parallel_shard`` (``torch.distributed.tensor.experimental._attention``), the
way torchtitan calls it: ``buffers`` is a pytree of tensors and ``BlockMask``s, ``seq_dims`` the
same tree of sequence dims.

- A tensor is reordered along its sequence dim by the balancer's order (one order for the
  batch, or one per sample, the batch being dim 0) and cut into ``n`` pieces as ``Shard`` cuts
  (``torch.chunk``): rank ``r`` keeps piece ``r``.
- A ``BlockMask`` (its ``seq_dim`` is ignored) becomes the mask of this rank's queries against
  the *whole* key sequence in the balanced order, i.e. against keys/values all-gathered from the
  ranks (:func:`shardprop.parallel.cp.flex.flex_cp_allgather`): a new block mask whose
  ``mask_mod`` maps a local query index to its global position (``r * q_len / n + i``, then
  through the order) and a key index through the order, before calling the original
  ``mask_mod``. Blocks are the default 128; the query length must divide by ``128 n``. The mask
  is built a band of query blocks at a time (:mod:`block_mask`; torch compiles
  ``create_block_mask`` instead): the same tables, in bounded memory.

The last call's balancer is also what :func:`shardprop.parallel.cp.dispatcher` assumes the
sequence layout to be for SDPA on sequence-sharded DTensors (as torch's global option).

Example:
    >>> tokens, mask = context_parallel_shard_buffers(mesh["cp"], [tokens, mask], [1, 2],  # doctest: +SKIP
    ...                                               PTRRLoadBalancer(mask, 2))
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardprop.parallel.cp.block_mask import block_mask_by_bands
from shardprop.parallel.cp.load_balance import HeadTailLoadBalancer, LoadBalancer

__all__ = ["context_parallel_shard_buffers", "shard_block_mask", "shard_tensor", "last_load_balancer", "layout_is_head_tail"]

_state = {"balancer": None}  # the last call's balancer (torch keeps the same as a global option)


def last_load_balancer() -> Optional[LoadBalancer]:
    """The balancer of the last :func:`context_parallel_shard_buffers` call (None: contiguous, or never called).

    Example:
        >>> last_load_balancer() is None
        True
    """
    return _state["balancer"]


def _mesh_place(mesh):
    if mesh.ndim != 1:
        raise ValueError(f"context parallel: the mesh must have one dim (pass e.g. mesh['cp']), got {mesh}")
    return mesh.size(), mesh.get_local_rank()


def _reorder(t: torch.Tensor, seq_dim: int, order: torch.Tensor) -> torch.Tensor:
    """``t`` with its ``seq_dim`` permuted by ``order`` ``(1 or B, S)``; per sample when ``order`` has B rows."""
    order = order.to(device=t.device, dtype=torch.int64)
    if order.shape[0] == 1 or seq_dim == 0:
        return t.index_select(seq_dim, order[0])
    if order.shape[0] != t.shape[0]:
        raise ValueError(f"context parallel: the load balancer gives {order.shape[0]} per-sample orders of "
                         f"{order.shape[1]} positions, but the buffer has shape {tuple(t.shape)}")
    view = [order.shape[0]] + [1] * (t.dim() - 1)
    view[seq_dim] = order.shape[1]
    return torch.gather(t, seq_dim, order.view(view).expand(t.shape))


def shard_tensor(t: torch.Tensor, mesh, seq_dim: int, order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's piece of ``t`` along ``seq_dim``, after reordering by ``order`` (a balancer's indices) if given.

    Example:
        >>> shard_tensor(torch.arange(8), mesh, 0, HeadTailLoadBalancer(8, 2, "cpu")._generate_indices())  # rank 1  # doctest: +SKIP
        tensor([2, 3, 4, 5])
    """
    n, r = _mesh_place(mesh)
    seq_dim = seq_dim % t.dim()
    if order is not None:
        if order.shape[-1] != t.shape[seq_dim]:
            raise ValueError(f"context parallel: the load balancer orders {order.shape[-1]} positions, but dim "
                             f"{seq_dim} of the buffer of shape {tuple(t.shape)} has {t.shape[seq_dim]}")
        t = _reorder(t, seq_dim, order)
    pieces = t.chunk(n, dim=seq_dim)
    if r < len(pieces):
        return pieces[r].contiguous()
    return t.narrow(seq_dim, 0, 0).contiguous()


def _local_mask_mod(mask_mod, q_offset: int, order: Optional[torch.Tensor]):
    """``mask_mod`` seen from this rank's queries: local query ``i`` is balanced position ``q_offset + i``."""
    if order is None:
        return lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx + q_offset, kv_idx)
    if order.shape[0] == 1:
        row = order[0]
        return lambda b, h, q_idx, kv_idx: mask_mod(b, h, row[q_idx + q_offset], row[kv_idx])
    return lambda b, h, q_idx, kv_idx: mask_mod(b, h, order[b][q_idx + q_offset], order[b][kv_idx])


def shard_block_mask(block_mask, mesh, balancer: Optional[LoadBalancer] = None, order: Optional[torch.Tensor] = None):
    """The ``BlockMask`` of this rank's queries (balanced by ``balancer``) against the whole, balanced key sequence.

    Example:
        >>> local = shard_block_mask(causal_mask, mesh["cp"], PTRRLoadBalancer(causal_mask, 2))  # doctest: +SKIP
    """
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE

    n, r = _mesh_place(mesh)
    q_len, kv_len = block_mask.seq_lengths
    block = _DEFAULT_SPARSE_BLOCK_SIZE
    if q_len % (n * block):
        raise NotImplementedError(f"context parallel: a BlockMask of query length {q_len} must divide into {n} "
                                  f"pieces of whole {block}-position blocks (a multiple of {n * block})")
    if order is None and balancer is not None:
        order = balancer._generate_indices()
    if order is not None:
        order = order.to(block_mask.kv_num_blocks.device)
    b, h = block_mask.kv_num_blocks.shape[:2]
    local = q_len // n
    device = mesh.device_type if hasattr(mesh, "device_type") else block_mask.kv_num_blocks.device
    return block_mask_by_bands(_local_mask_mod(block_mask.mask_mod, r * local, order), b, h, local, kv_len,
                               device, block)


def context_parallel_shard_buffers(mesh, buffers: Any, seq_dims: Any,
                                   load_balancer: Optional[LoadBalancer] = None) -> Any:
    """Each tensor/BlockMask of the pytree ``buffers`` cut to this rank's part (module doc); the same tree back.

    Example:
        >>> ids, labels = context_parallel_shard_buffers(mesh["cp"], [ids, labels], [1, 1],  # doctest: +SKIP
        ...                                              HeadTailLoadBalancer(ids.shape[1], 2, "cpu"))
    """
    if len(buffers) != len(seq_dims):
        raise ValueError("context parallel: `seq_dims` must have the same number of elements as `buffers`")
    flat, spec = tree_flatten(buffers)
    flat_dims, _ = tree_flatten(seq_dims)
    if len(flat) != len(flat_dims):
        raise ValueError("context parallel: `seq_dims` must have the same pytree structure as `buffers`")
    devices = {(x.device if isinstance(x, torch.Tensor) else x.kv_num_blocks.device) for x in flat}
    if len(devices) > 1:
        raise ValueError(f"context parallel: all buffers must be on one device, got {sorted(map(str, devices))}")
    _state["balancer"] = load_balancer
    order = load_balancer._generate_indices() if load_balancer is not None else None
    if order is not None and order.dim() != 2:
        raise ValueError(f"context parallel: a load balancer's order is (1 or batch, seq_len), got {tuple(order.shape)}")
    out: List[Any] = []
    for x, d in zip(flat, flat_dims):
        if isinstance(x, torch.Tensor):
            out.append(shard_tensor(x, mesh, d, order))
        elif hasattr(x, "kv_num_blocks") and hasattr(x, "mask_mod"):
            out.append(shard_block_mask(x, mesh, load_balancer, order))
        else:
            raise ValueError(f"context parallel: cannot shard a buffer of type {type(x).__name__}")
    return tree_unflatten(out, spec)


def layout_is_head_tail() -> Optional[bool]:
    """Whether the last sharding was head-tail balanced (True), contiguous (False), or another order (None).

    Example:
        >>> layout_is_head_tail()  # nothing sharded yet
        False
    """
    balancer = _state["balancer"]
    if balancer is None:
        return False
    return True if isinstance(balancer, HeadTailLoadBalancer) else None
