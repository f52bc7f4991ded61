"""The rule checker's arithmetic of layouts: cut a full sample into each rank's piece under a
layout (Partial values split into random parts that reduce to it), and rebuild the global value
of per-rank pieces from the definition of the placements (never through the engine's own
redistribution, so a bug there cannot hide a rule bug).
"""
from __future__ import annotations

import itertools
import zlib
from typing import List, Optional, Tuple

import torch

from shardprop.tensor.layout import chunk_bounds
from shardprop.tensor.placement import Partial, Placement, Replicate, Shard

# Partials tried for inputs and searched for outputs. "product" is judged when a rule offers it
# (``_combine``) and may be asked for through ``input_layouts``, but is not enumerated: few ops keep it.
REDUCTIONS = ("sum", "avg", "max", "min")


# ---------------------------------------------------------------- sample handling
def map_tensors(obj, fn):
    """Rebuild args with every tensor leaf replaced by ``fn(tensor)`` (in argument order)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    return obj


def seeded(*key) -> torch.Generator:
    """A generator seeded from ``key`` the same way on every rank (crc32, never hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def perturbed(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A non-round variant of ``t`` (same shape, strides, dtype) with both signs unless ``t`` has one."""
    if not t.is_floating_point() or t.numel() == 0:
        return t.detach().clone()
    mag = torch.rand(t.shape, generator=gen, dtype=torch.float64) * 1.37 + 0.37
    sign = torch.where(torch.rand(t.shape, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
    if bool((t >= 0).all()):
        sign = sign.abs()
    elif bool((t <= 0).all()):
        sign = -sign.abs()
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_((mag * sign).to(t.dtype))


def placement_options(t: torch.Tensor) -> List[Placement]:
    """Per-mesh-dim placements worth trying for one argument (Partial only for floating values)."""
    opts: List[Placement] = [Replicate()] + [Shard(d) for d in range(t.ndim)]
    if t.is_floating_point():
        opts += [Partial(r) for r in REDUCTIONS]
    return opts


def _split_partial(value: torch.Tensor, reduce_op: str, k: int, gen: torch.Generator) -> List[torch.Tensor]:
    """``k`` values whose ``reduce_op`` reduction is ``value`` (and that are not all equal)."""
    if k == 1:
        return [value]
    work = value.to(torch.float64)
    scale = float(work.abs().mean()) + 0.5 if work.numel() else 1.0

    def noise():
        return torch.randn(value.shape, generator=gen, dtype=torch.float64) * scale

    if reduce_op == "sum":
        parts = [noise() for _ in range(k - 1)]
        parts.append(work - sum(parts))
    elif reduce_op == "avg":
        r = [noise() for _ in range(k)]
        mean = sum(r) / k
        parts = [work + x - mean for x in r]
    elif reduce_op == "product":  # factors of either sign, away from zero; the last one makes up the value
        parts = [(torch.rand(value.shape, generator=gen, dtype=torch.float64) + 0.5)
                 * torch.where(torch.rand(value.shape, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
                 for _ in range(k - 1)]
        rest = torch.ones_like(work)
        for f in parts:
            rest = rest * f
        parts.append(work / rest)
    else:  # max/min: the true value on one rank per element (not always the same one)
        # The others are smaller (larger) by 10-50% of the value, so they keep its sign: an op with
        # a domain (log) still runs on them, and a clipping op (relu) does not zero them, which
        # would make a sum of the results equal their max by accident.
        owner = torch.randint(k, value.shape, generator=gen)
        sign = -1.0 if reduce_op == "max" else 1.0

        def other():
            u = torch.rand(value.shape, generator=gen, dtype=torch.float64)
            return work + sign * (work.abs() * (0.1 + 0.4 * u) + 1e-3 * scale)

        parts = [torch.where(owner == i, work, other()) for i in range(k)]
    return [p.to(value.dtype) for p in parts]


def local_input(full: torch.Tensor, layout, mesh_shape, coord, key) -> torch.Tensor:
    """This coordinate's piece of ``full`` laid out as ``layout`` (outermost mesh dim first)."""
    value = full
    for m, p in enumerate(layout):
        if type(p) is Shard:
            off, ln = chunk_bounds(value.shape[p.dim], mesh_shape[m], coord[m])
            value = value.narrow(p.dim, off, ln)
        elif type(p) is Partial:
            # Every rank sharing coord[:m] builds the same parts: the seed depends only on it.
            parts = _split_partial(value, p.reduce_op, mesh_shape[m], seeded(key, m, tuple(coord[:m])))
            value = parts[coord[m]]
    return value.contiguous().clone()


# ---------------------------------------------------------------- global value of a layout
def _close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True))
    return bool(torch.equal(a, b))


def _combine(group: List[torch.Tensor], p: Placement, atol: float, rtol: float) -> Optional[torch.Tensor]:
    """The value ``group`` (one piece per index along a mesh dim) stands for under ``p``, or None."""
    first = group[0]
    if type(p) is Shard:
        d = p.dim
        if any(g.ndim <= d or g.ndim != first.ndim for g in group):
            return None
        if any(g.shape[:d] != first.shape[:d] or g.shape[d + 1:] != first.shape[d + 1:] for g in group):
            return None
        total = sum(g.shape[d] for g in group)
        if any(g.shape[d] != chunk_bounds(total, len(group), i)[1] for i, g in enumerate(group)):
            return None  # not torch.chunk order: the spec would put the data elsewhere
        return torch.cat(group, d)
    if any(g.shape != first.shape or g.dtype != first.dtype for g in group):
        return None
    if type(p) is Replicate:
        return first if all(_close(g, first, atol, rtol) for g in group[1:]) else None
    stacked = torch.stack(group)
    if p.reduce_op == "sum":
        return stacked.sum(0)
    if p.reduce_op == "avg":
        return stacked.mean(0)
    if p.reduce_op == "product":
        return stacked.prod(0)
    return stacked.amax(0) if p.reduce_op == "max" else stacked.amin(0)


def _output_options(ref: torch.Tensor) -> List[Placement]:
    """Per-mesh-dim placements an output could have (Partial only for floating values)."""
    per_dim: List[Placement] = [Replicate()] + [Shard(d) for d in range(ref.ndim)]
    if ref.is_floating_point():
        per_dim += [Partial(r) for r in REDUCTIONS]
    return per_dim


def correct_layouts(pieces, ref, mesh_shape, atol, rtol, only=None,
                     first_only=False) -> Tuple[Tuple[Placement, ...], ...]:
    """Every output layout (or just ``only``) under which ``pieces`` form ``ref``, simplest first.

    Mesh dims are combined innermost first and a placement that cannot combine a mesh
    dim's pieces is dropped before any outer dim is tried, so few of the n**ndim
    layouts are ever built.
    """
    options = _output_options(ref)
    found = []

    def combine(group, p):
        try:
            return _combine(group, p, atol, rtol)
        except Exception:  # pieces that cannot be combined this way (dtype, shape): not this layout
            return None

    def walk(m, level, suffix) -> bool:
        if m < 0:
            if _close(level[()], ref, atol, rtol):
                found.append(suffix)
                return first_only
            return False
        for p in ([only[m]] if only is not None else options):
            nxt = {}
            for prefix in itertools.product(*(range(s) for s in mesh_shape[:m])):
                v = combine([level[prefix + (i,)] for i in range(mesh_shape[m])], p)
                if v is None:
                    break
                nxt[prefix] = v
            else:
                if walk(m - 1, nxt, (p,) + suffix):
                    return True
        return False

    walk(len(mesh_shape) - 1, pieces, ())
    rank = {p: i for i, p in enumerate(options)}
    return tuple(sorted(found, key=lambda layout: [rank.get(p, 0) for p in layout]))
