"""Draw this rank's shard of ``torch.rand`` / ``torch.randn`` without the full tensor.

Semantics (the same as shardprop's random ops, see ``shardprop.dispatch.random_ops``): with every
rank's generator in the same state, the shard a rank gets is exactly the matching piece of what one
device draws for the global shape, and afterwards every generator is where one device's would be.

How, without a full-size tensor: the global tensor is drawn as a stream of pieces, in row-major
order, into one reused buffer of about the local size; each piece is drawn by torch's own kernel
and the elements of this rank's box are copied out. That is exact only where drawing a tensor
in pieces gives the same values as drawing it at once. On CPU it does: ``uniform_`` draws each
element in order, and ``normal_`` works in blocks of 16 (pieces then start at multiples of 16
and the last piece holds at least 16). Each (kind, dtype, device type) is checked once on a
private generator before it is trusted; where the check fails (CUDA's Philox kernels lay values
out by thread, not in order) the full tensor is drawn and cut, as the random ops do.

Cost: each rank spends the time of drawing the whole tensor (that keeps generators in step);
memory is the shard plus a buffer of ``max(local numel, 4096)`` elements.

Example:
    >>> local = draw_shard("uniform", (8, 6), (2, 0), (2, 6), torch.float32, torch.device("cpu"))  # doctest: +SKIP
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

_MIN_PIECE = 4096  # elements: below this the per-piece Python overhead dominates
_ALIGN = 16  # normal_'s block: pieces start at multiples of it


def _fill(t: torch.Tensor, kind: str, generator=None) -> None:
    if kind == "uniform":
        t.uniform_(0, 1, generator=generator)
    else:
        t.normal_(0, 1, generator=generator)


@functools.lru_cache(maxsize=None)
def composable(kind: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether drawing in pieces (aligned to 16, last piece >= 16) equals drawing at once, here.

    Checked once on private generators: values and the generator state afterwards.

    Example:
        >>> composable("normal", torch.float32, torch.device("cpu"))
        True
    """
    n, cuts = 16 * 5 + 7, (16, 48)
    try:
        g1 = torch.Generator(device).manual_seed(20240607)
        whole = torch.empty(n, dtype=dtype, device=device)
        _fill(whole, kind, g1)
        g2 = torch.Generator(device).manual_seed(20240607)
        pieces, a = [], 0
        for b in cuts + (n,):
            p = torch.empty(b - a, dtype=dtype, device=device)
            _fill(p, kind, g2)
            pieces.append(p)
            a = b
        return torch.equal(whole, torch.cat(pieces)) and torch.equal(g1.get_state(), g2.get_state())
    except Exception:  # an unsupported dtype: the full draw raises torch's own error
        return False


def _pieces(n: int, size: int):
    """[a, b) ranges covering [0, n): starts at multiples of ``size``; a short tail joins the piece before."""
    out, a = [], 0
    while a < n:
        b = min(a + size, n)
        if n - b < _ALIGN:
            b = n
        out.append((a, b))
        a = b
    return out


def _count_before(x: int, gshape, off, bshape, inner) -> int:
    """How many points of the box (offset ``off``, shape ``bshape``) come before flat index ``x``."""
    coords = []
    for s in reversed(gshape):
        coords.append(x % s)
        x //= s
    if x:  # x == numel: past every point
        return inner[0] * bshape[0]
    coords.reverse()
    count = 0
    for d, c in enumerate(coords):
        c -= off[d]
        count += min(max(c, 0), bshape[d]) * inner[d]
        if not 0 <= c < bshape[d]:
            break
    return count


def _global_index(pos: torch.Tensor, gstride, off, bshape) -> torch.Tensor:
    """Global flat indices of the box's points at local row-major positions ``pos``."""
    out = torch.zeros_like(pos)
    for d in reversed(range(len(bshape))):
        out += (pos % bshape[d] + off[d]) * gstride[d]
        pos = pos // bshape[d]
    return out


def draw_shard(kind: str, gshape: Sequence[int], off: Sequence[int], bshape: Sequence[int],
               dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's box (offset ``off``, shape ``bshape``) of a ``kind`` ("uniform"/"normal") draw of ``gshape``.

    Advances the default generator of ``device`` exactly as drawing the whole tensor would.

    Example:
        >>> _ = torch.manual_seed(0); a = draw_shard("normal", (5, 7), (1, 2), (3, 4), torch.float32, torch.device("cpu"))
        >>> _ = torch.manual_seed(0); torch.equal(a, torch.randn(5, 7)[1:4, 2:6])
        True
    """
    gshape, off, bshape = tuple(gshape), tuple(off), tuple(bshape)
    local = torch.empty(bshape, dtype=dtype, device=device)
    n = 1
    for s in gshape:
        n *= s
    if n == 0:
        return local
    if not gshape or not composable(kind, dtype, device):
        full = torch.empty(gshape, dtype=dtype, device=device)
        _fill(full, kind)
        return local.copy_(full[tuple(slice(o, o + b) for o, b in zip(off, bshape))])
    nd = len(gshape)
    inner, gstride = [1] * nd, [1] * nd
    for d in range(nd - 2, -1, -1):
        inner[d] = inner[d + 1] * bshape[d + 1]
        gstride[d] = gstride[d + 1] * gshape[d + 1]
    total = local.numel()
    size = -(-max(total, _MIN_PIECE) // _ALIGN) * _ALIGN
    buf = torch.empty(min(size + _ALIGN, n), dtype=dtype, device=device)
    flat = local.view(-1)
    for a, b in _pieces(n, size):
        piece = buf[: b - a]
        _fill(piece, kind)
        p0 = _count_before(a, gshape, off, bshape, inner) if total else 0
        p1 = _count_before(b, gshape, off, bshape, inner) if total else 0
        if p1 > p0:
            idx = _global_index(torch.arange(p0, p1, device=device), gstride, off, bshape) - a
            first, last = int(idx[0]), int(idx[-1])
            if last - first == p1 - p0 - 1:  # a run of consecutive elements (e.g. Shard(0)): a slice
                flat[p0:p1] = piece[first:last + 1]
            else:
                flat[p0:p1] = piece[idx]
    return local
