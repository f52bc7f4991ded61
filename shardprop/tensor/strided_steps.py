"""The two redistribution steps of ``_StridedShard`` (layout in ``strided.py``), as ``steps.py`` prepares them.

``_StridedShard -> Replicate``: a padded all-gather on the mesh dim, then one reorder
(``index_select``) into the parent's order. ``Replicate -> _StridedShard``: a local pick.

Example:
    >>> fn, shape = prep_strided_chunk(step, cur, spec, local.shape, 8)  # doctest: +SKIP
"""
from __future__ import annotations

import torch

from shardprop.mesh import collectives as C
from shardprop.mesh.async_tensor import wait_all
from shardprop.tensor.strided import strided_positions


# Each preparer returns (step closure, local shape after the step), as steps.py's do. They take
# the parent's length (what mesh dim m splits, earlier mesh dims applied) from the caller.
def prep_strided_gather(step, cur, spec, shape, parent_len):
    """``_StridedShard -> Replicate`` on one mesh dim: a padded all-gather, then one reorder (index_select)."""
    mesh = spec.mesh
    m = step.mesh_dims[0]
    p = cur[m]
    d, k = p.dim, mesh.shape[m]
    n = parent_len
    per_rank = [strided_positions(n, k, p.split_factor, r) for r in range(k)]
    c = max(len(x) for x in per_rank)
    piece = list(shape)
    piece[d] = c
    final = list(shape)
    final[d] = n
    # where[pos] = slot of parent position pos in the gathered (k * c along d) tensor
    where = [0] * n
    for r, pos in enumerate(per_rank):
        for i, q in enumerate(pos):
            where[q] = r * c + i
    stacked_d = piece[:d] + [k * c] + piece[d + 1:]

    def fix(buf):
        g = buf.view([k] + piece).movedim(0, d).reshape(stacked_d)
        return g.index_select(d, torch.tensor(where, dtype=torch.long, device=g.device))

    def gather(local, owned, async_op):
        x = wait_all(local)
        if x.shape[d] != c:
            padded = x.new_zeros(piece)
            padded.narrow(d, 0, x.shape[d]).copy_(x)
            x = padded
        out = C.all_gather(x.contiguous(), mesh, (m,), async_op=False, pooled=False)
        return fix(wait_all(out))
    return gather, tuple(final)


def prep_strided_chunk(step, cur, spec, shape, parent_len):
    """``Replicate -> _StridedShard`` on one mesh dim: a local pick of this rank's positions (a copy)."""
    mesh = spec.mesh
    m = step.mesh_dims[0]
    p = step.dst[0]
    d = p.dim
    pos = strided_positions(parent_len, mesh.shape[m], p.split_factor, mesh._coord[m])
    out_shape = list(shape)
    out_shape[d] = len(pos)

    def chunk(local, owned, async_op):
        x = wait_all(local)
        return x.index_select(d, torch.tensor(pos, dtype=torch.long, device=x.device))
    return chunk, tuple(out_shape)
