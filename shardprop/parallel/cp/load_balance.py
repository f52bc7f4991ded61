"""Sequence load balancers for context parallelism: which positions each rank holds.

A balancer gives a permutation of the sequence positions (``_generate_indices()``: shape
``(1, seq_len)``, or ``(batch, seq_len)`` where the order differs per sample). Buffers are
reordered by it and then cut into ``n`` equal contiguous pieces, piece ``r`` going to rank ``r``
(:mod:`shardprop.parallel.cp.shard`). ``_generate_indices(restore=True)`` is the inverse
permutation (``x[order][restore] == x``).

- :class:`HeadTailLoadBalancer`: ``2n`` equal chunks; rank ``r`` holds chunk ``r`` then chunk
  ``2n-1-r``. Under a causal mask every rank then does the same work; it is the layout ring
  attention calls balanced (:mod:`shardprop.parallel.cp.ring_attention`).
- :class:`PerDocumentHeadTailLoadBalancer`: head-tail chunks inside every document of a packed sequence.
- :class:`PTRRLoadBalancer` (processing-time round robin, for flex attention): from a
  ``BlockMask``, the cost of each query block is the number of key blocks it visits. Blocks are
  sorted by cost, most expensive first (ties keep their order), and dealt to the ``n`` ranks in a
  snake (``0..n-1``, then ``n-1..0``, ...); each rank keeps its blocks in position order.

These are torch's ``_HeadTailLoadBalancer``, ``_PerDocumentHeadTailLoadBalancer`` and
``_PTRRLoadBalancer`` (``torch.distributed.tensor.experimental._attention``), with the same
constructor arguments and the same permutations (dtypes included: int32 for head-tail, int64
otherwise).

Example:
    >>> HeadTailLoadBalancer(8, 2, "cpu")._generate_indices()
    tensor([[0, 1, 6, 7, 2, 3, 4, 5]], dtype=torch.int32)
"""
from __future__ import annotations

from typing import List, Sequence, Union

import torch

__all__ = ["LoadBalancer", "HeadTailLoadBalancer", "PerDocumentHeadTailLoadBalancer", "PTRRLoadBalancer",
           "ptrr_groups"]


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """The inverse permutation of each row of ``order`` (as ``argsort``: int64)."""
    return torch.argsort(order, dim=-1)


class LoadBalancer:
    """A rule for reordering the sequence before it is cut into equal contiguous pieces, one per rank."""

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        """The order (``restore=False``) or its inverse (``restore=True``): ``(1 or batch, seq_len)``."""
        raise NotImplementedError(f"{type(self).__name__} does not define _generate_indices")


def _head_tail(starts_lengths: Sequence[tuple], n: int, device) -> List[torch.Tensor]:
    """For each (start, length) segment: its ``2n`` chunks in the order head 0, tail 0, head 1, tail 1, ..."""
    pieces = []
    for start, length in starts_lengths:
        if length % (2 * n):
            raise ValueError(f"head-tail load balancing: a sequence of {length} positions does not divide into "
                             f"{2 * n} equal chunks for {n} ranks")
        c = length // (2 * n)
        for r in range(n):
            pieces.append(torch.arange(start + r * c, start + (r + 1) * c, device=device))
            pieces.append(torch.arange(start + (2 * n - 1 - r) * c, start + (2 * n - r) * c, device=device))
    return pieces


class HeadTailLoadBalancer(LoadBalancer):
    """Rank ``r`` holds chunks ``r`` and ``2n-1-r`` of ``2n`` (module doc); ``seq_length`` must divide by ``2n``.

    Example:
        >>> HeadTailLoadBalancer(8, 2, "cpu")._generate_indices(restore=True)
        tensor([[0, 1, 4, 5, 6, 7, 2, 3]])
    """

    def __init__(self, seq_length: int, world_size: int, device: Union[str, torch.device]):
        self.seq_length, self.world_size, self.device = seq_length, world_size, device

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        order = torch.cat(_head_tail([(0, self.seq_length)], self.world_size, self.device)).to(torch.int32)
        order = order.unsqueeze(0)
        return _inverse(order) if restore else order


class PerDocumentHeadTailLoadBalancer(LoadBalancer):
    """Head-tail inside every document: ``seq_length_per_doc[b]`` lists sample ``b``'s document lengths.

    Each document's length must divide by ``2n``. The order is torch 2.15's: rank by rank, each
    rank's head and tail chunk of every document in turn, so the ``r``-th equal piece of the
    sequence is exactly rank ``r``'s chunks (torch 2.13 ordered document by document).

    Example:
        >>> PerDocumentHeadTailLoadBalancer([[4, 4]], 2, "cpu")._generate_indices()
        tensor([[0, 3, 4, 7, 1, 2, 5, 6]])
    """

    def __init__(self, seq_length_per_doc: List[List[int]], world_size: int, device: Union[str, torch.device]):
        self.seq_length_per_doc, self.world_size, self.device = seq_length_per_doc, world_size, device

    def _one(self, lengths: Sequence[int]) -> torch.Tensor:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        n = self.world_size
        per_doc = _head_tail(list(zip(starts, lengths)), n, self.device)  # per document: head 0, tail 0, head 1, ...
        return torch.cat([per_doc[2 * (d * n + r) + k] for r in range(n) for d in range(len(lengths)) for k in (0, 1)])

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        order = torch.stack([self._one(lengths) for lengths in self.seq_length_per_doc])
        return _inverse(order) if restore else order


def ptrr_groups(cost: torch.Tensor, n: int) -> torch.Tensor:
    """Deal the tasks of 1-D ``cost`` to ``n`` groups by processing-time round robin: ``(n, len // n)`` task ids.

    Most expensive first (a stable sort: equal costs keep their order), in a snake over the
    groups; each group's ids ascending.

    Example:
        >>> ptrr_groups(torch.tensor([1, 4, 2, 3]), 2)
        tensor([[0, 1],
                [2, 3]])
    """
    if cost.dim() != 1:
        raise ValueError(f"ptrr_groups: expects a 1-D tensor of task costs, got shape {tuple(cost.shape)}")
    if cost.numel() % n:
        raise NotImplementedError(f"ptrr_groups: {cost.numel()} tasks do not divide into {n} equal groups")
    ranked = torch.sort(cost, descending=True, stable=True).indices.view(-1, n).clone()
    ranked[1::2] = ranked[1::2].flip(1)  # every other round goes back from the last group to the first
    return torch.sort(ranked.t(), dim=1).values


class PTRRLoadBalancer(LoadBalancer):
    """Processing-time round robin over the query blocks of ``block_mask`` (module doc); for flex attention.

    ``block_mask`` has one head (``(B or 1, 1, q_len, kv_len)``), equal query and key block sizes.

    Example:
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> m = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 512, 512, device="cpu")
        >>> PTRRLoadBalancer(m, 2)._generate_indices()[0, ::128]
        tensor([  0, 384, 128, 256])
    """

    def __init__(self, block_mask, world_size: int):
        self.block_mask, self.world_size = block_mask, world_size

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        m = self.block_mask
        cost = m.kv_num_blocks if m.full_kv_num_blocks is None else m.kv_num_blocks + m.full_kv_num_blocks
        b, h, q_blocks = cost.shape
        if h != 1:
            raise ValueError(f"PTRR load balancing needs one mask for all heads (a BlockMask with H == 1), got H={h}")
        q_block, kv_block = m.BLOCK_SIZE
        if q_block != kv_block:
            raise AssertionError(f"PTRR load balancing needs equal query and key block sizes, got {m.BLOCK_SIZE}")
        rows = []
        for cost_b in cost.view(b, q_blocks):
            blocks = ptrr_groups(cost_b, self.world_size).reshape(-1)  # rank 0's blocks, then rank 1's, ...
            rows.append((blocks.unsqueeze(1) * q_block + torch.arange(q_block, device=blocks.device)).reshape(-1))
        order = torch.stack(rows)
        return _inverse(order) if restore else order
