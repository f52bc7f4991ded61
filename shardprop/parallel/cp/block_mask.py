"""A flex-attention ``BlockMask`` built a band of query blocks at a time, in bounded memory, without compiling.

``create_block_mask`` evaluated eagerly materialises the whole ``B x H x q_len x kv_len`` element
mask (torch's context parallelism compiles it to avoid that). Here the element mask is evaluated
for a band of query blocks at a time (at most :data:`MAX_ELEMENTS` elements), each band reduced at
once to its block table (a block is *full* when every element attends, *partial* when some do),
and the tables are ordered as ``create_block_mask`` orders them (per query block: the key blocks
with any attention first, in increasing order, a stable sort), so the ``BlockMask`` is
``create_block_mask``'s, table for table. Public torch API only: ``create_mask`` and
``BlockMask.from_kv_blocks`` (the same in torch 2.11 to 2.15).

Example:
    >>> m = block_mask_by_bands(lambda b, h, q, kv: q >= kv, 1, 1, 256, 256, "cpu")
    >>> m.kv_num_blocks.tolist(), m.full_kv_num_blocks.tolist()
    ([[[1, 1]]], [[[0, 1]]])
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["MAX_ELEMENTS", "block_mask_by_bands"]

MAX_ELEMENTS = 1 << 26  # elements of the element mask evaluated at once (64 MiB of bools)


def _ordered(dense: torch.Tensor):
    """(count per row, column indices with the set ones first, ascending): ``create_block_mask``'s order."""
    dense = dense.to(torch.int32)
    return (dense.sum(-1).to(torch.int32).contiguous(),
            torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32).contiguous())


def block_mask_by_bands(mask_mod, B: int, H: int, q_len: int, kv_len: int, device, block: int = 128,
                        max_elements: int = MAX_ELEMENTS):
    """``create_block_mask(mask_mod, B, H, q_len, kv_len, device, BLOCK_SIZE=block)``, evaluated band by band.

    Example:
        >>> m = block_mask_by_bands(lambda b, h, q, kv: q >= kv, 1, 1, 384, 384, "cpu", max_elements=1)
        >>> m.kv_num_blocks.tolist()
        [[[1, 1, 1]]]
    """
    from torch.nn.attention.flex_attention import BlockMask, create_mask

    q_blocks, kv_blocks = -(-q_len // block), -(-kv_len // block)
    band = max(1, max_elements // max(1, B * H * block * kv_blocks * block))  # query blocks per band
    partial, full = [], []
    whole = block * block
    for first in range(0, q_blocks, band):
        last = min(q_blocks, first + band)
        rows = min(last * block, q_len) - first * block
        offset = first * block
        m = create_mask(lambda b, h, q, kv: mask_mod(b, h, q + offset, kv), B, H, rows, kv_len, device)
        m = F.pad(m, (0, kv_blocks * block - kv_len, 0, (last - first) * block - rows))
        counts = m.view(B, H, last - first, block, kv_blocks, block).sum(dim=(3, 5))
        full.append(counts == whole)
        partial.append((counts > 0) & (counts < whole))
    kv_num, kv_idx = _ordered(torch.cat(partial, dim=2))
    full_num, full_idx = _ordered(torch.cat(full, dim=2))
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(block, block),
                                    mask_mod=mask_mod, seq_lengths=(q_len, kv_len))
