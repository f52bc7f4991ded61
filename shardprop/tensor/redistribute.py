"""Redistribution: plan the collectives between two placement lists, then run them.

Planning is per mesh dim (table in DESIGN.md) and cached per (source spec,
target placements). Two phases keep nested shards right (several mesh dims
sharding one tensor dim, outermost first):

1. innermost mesh dim first, every shard that must change is undone (all-gather),
   or turned straight into another shard (all-to-all) when no other mesh dim
   touches either tensor dim;
2. outermost first, the target is built: local chunks, partial→shard
   reduce-scatters, then all-reduces last so they move the fewest bytes.

A mesh dim whose shard stays the same is still redone when an earlier mesh dim
sharding the same tensor dim changes, since its piece is cut from a different
parent. Gathers that span several mesh dims (and all-reduces likewise) are fused
into one collective over the group of those dims when shapes are even.

Transitions without Partial are also priced as one batch of point-to-point messages
(``permute.py``): where each rank needs only a few other ranks' pieces (``[S(0), R] ->
[R, S(0)]`` on 2x2) that is cheaper, and the plan is that one step. Its ``fallback`` (the
collective plan) runs instead while torch.compile traces.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from shardprop.mesh import buffer_pool
from shardprop.mesh import collectives as C
from shardprop.mesh.async_tensor import wait_all
from shardprop.tensor import permute
from shardprop.tensor.layout import chunk_bounds, is_even, local_shape_and_offset
from shardprop.tensor.placement import Partial, Placement, Replicate, Shard
from shardprop.tensor.spec import DTensorSpec

# Relative cost per byte each rank moves, by collective (ring algorithms);
# LATENCY is a fixed cost per collective, in byte-equivalents.
COST_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0, "all_reduce": 2.0,
               "p2p": permute.P2P_FACTOR, "chunk": 0.0, "to_partial": 0.0}
LATENCY = 4096.0


@dataclass(frozen=True)
class Step:
    """One transition on one or more mesh dims (several only for fused collectives)."""

    kind: str                       # key of COST_FACTOR
    mesh_dims: Tuple[int, ...]
    src: Tuple[Placement, ...]
    dst: Tuple[Placement, ...]
    bytes: int                      # bytes each rank sends or receives (estimate, even split)

    def __repr__(self) -> str:
        return f"{self.kind}@{list(self.mesh_dims)}: {list(self.src)}->{list(self.dst)} ({self.bytes} B)"


@dataclass(frozen=True)
class Plan:
    """The ordered steps from one spec to another, and what they cost."""

    steps: Tuple[Step, ...]
    cost: float
    # The collective plan a point-to-point plan stands in for: what runs while torch.compile traces.
    fallback: Optional["Plan"] = None

    @property
    def collectives(self) -> Tuple[Step, ...]:
        return tuple(s for s in self.steps if COST_FACTOR[s.kind] > 0)


def _hint(n) -> int:
    """An int size as is; a symbolic one (torch.compile, dynamic shapes) by its example value.

    Costs only rank strategies: reading the example value adds no guard to the graph.
    """
    if type(n) is int:
        return n
    hint = getattr(getattr(n, "node", None), "hint", None)
    return int(hint) if hint is not None else 1024


def local_bytes(spec: DTensorSpec, placements) -> float:
    """Bytes of one rank's shard of ``spec`` laid out as ``placements`` (even split: a cost estimate)."""
    numel = math.prod(_hint(n) for n in spec.shape) if spec.ndim else 1
    for m, p in enumerate(placements):
        if type(p) is Shard:
            numel /= spec.mesh.shape[m]
    return numel * spec.dtype.itemsize


def _step(kind: str, dims, cur: List[Placement], dst, spec: DTensorSpec) -> Step:
    dims = tuple(dims)
    k = math.prod(spec.mesh.shape[m] for m in dims)
    if kind == "all_gather":
        after = list(cur)
        for m in dims:
            after[m] = Replicate()
        moved = local_bytes(spec, after) * (k - 1) / k
    elif kind in ("all_reduce", "reduce_scatter", "all_to_all"):
        moved = local_bytes(spec, cur) * (k - 1) / k
    else:
        moved = 0
    return Step(kind, dims, tuple(cur[m] for m in dims), tuple(dst), int(moved))


def _changed(src, dst) -> List[bool]:
    out = []
    for m, (s, t) in enumerate(zip(src, dst)):
        ch = s != t
        if not ch and type(s) is Shard:
            ch = any(out[k] and (src[k] == s or dst[k] == s) for k in range(m))
        out.append(ch)
    return out


@functools.lru_cache(maxsize=4096)
def plan_redistribute(src: DTensorSpec, dst_placements: Tuple[Placement, ...]) -> Plan:
    """The cached plan that turns ``src`` into ``dst_placements`` on the same mesh.

    Example:
        >>> plan_redistribute(spec_s0, (Replicate(),)).steps  # doctest: +SKIP
        (all_gather@[0]: [S(0)]->[R] (...),)
    """
    n = len(dst_placements)
    dst = list(dst_placements)
    # A mesh dim of size 1 splits nothing and reduces nothing: its placement is a label.
    cur = [dst[m] if src.mesh.shape[m] == 1 else p for m, p in enumerate(src.placements)]
    changed = _changed(cur, dst)
    steps: List[Step] = []

    def shard_dims_elsewhere(m: int, dims) -> bool:
        return any(type(p) is Shard and p.dim in dims for k in range(n) if k != m for p in (cur[k], dst[k]))

    # Phase 1: undo changed shards, innermost mesh dim first.
    gathers: List[int] = []
    for m in reversed(range(n)):
        s, t = cur[m], dst[m]
        if not changed[m] or type(s) is not Shard:
            continue
        if type(t) is Shard and t.dim != s.dim and not shard_dims_elsewhere(m, (s.dim, t.dim)):
            steps.append(_step("all_to_all", (m,), cur, (t,), src))
            cur[m] = t
        else:
            gathers.append(m)
            steps.append(_step("all_gather", (m,), cur, (Replicate(),), src))
            cur[m] = Replicate()
    steps = _fuse_gathers(steps, gathers, src)

    # Phase 2: build the target, outermost first; all-reduces wait till the end.
    reduces: List[int] = []
    for m in range(n):
        s, t = cur[m], dst[m]
        if s == t:
            continue
        if type(s) is Partial:
            if type(t) is Shard:
                steps.append(_step("reduce_scatter", (m,), cur, (t,), src))
                cur[m] = t
            else:  # to Replicate, or to another reduce op (reduce fully, then re-partial)
                reduces.append(m)
            continue
        steps.append(_step("chunk" if type(t) is Shard else "to_partial", (m,), cur, (t,), src))
        cur[m] = t
    steps.extend(_reduce_steps(reduces, cur, dst, src))
    steps_t = tuple(steps)
    cost = sum(COST_FACTOR[s.kind] * s.bytes + (LATENCY if COST_FACTOR[s.kind] else 0) for s in steps_t)
    plan = Plan(steps_t, cost)
    p2p = p2p_plan(src, dst_placements, plan)
    return p2p if p2p is not None and p2p.cost < plan.cost else plan


def p2p_plan(src: DTensorSpec, dst_placements: Tuple[Placement, ...], fallback: Optional[Plan] = None) -> Optional[Plan]:
    """The point-to-point plan of this transition and its price, or None where it does not apply.

    ``plan_redistribute`` takes it when it is strictly cheaper than the collectives.

    Example:
        >>> p2p_plan(spec_s0_r_2x2, (Replicate(), Shard(0))).steps  # doctest: +SKIP
        (p2p@[0, 1]: [S(0), R]->[R, S(0)] (...),)
    """
    mesh = src.mesh
    cur = tuple(dst_placements[m] if mesh.shape[m] == 1 else p for m, p in enumerate(src.placements))
    dst = tuple(dst_placements)
    if cur == dst or mesh._coord is None or not permute.eligible(src.shape, cur, dst):
        return None
    price = permute.p2p_price(tuple(src.shape), mesh, cur, dst, src.dtype.itemsize)
    if price is None:
        return None
    step = Step("p2p", tuple(range(mesh.ndim)), cur, dst, price.bytes)
    return Plan((step,), COST_FACTOR["p2p"] * price.bytes + LATENCY * price.max_peers, fallback)


def _fuse_gathers(steps: List[Step], gathers: List[int], spec: DTensorSpec) -> List[Step]:
    """Replace several single-dim gathers by one over the group of those mesh dims, when safe."""
    if len(gathers) < 2:
        return steps
    dims = tuple(sorted(gathers))
    src = spec.placements
    tensor_dims = {src[m].dim for m in dims}
    others_touch = any(type(p) is Shard and p.dim in tensor_dims for m, p in enumerate(src) if m not in dims)
    group = spec.mesh.group_for(dims)
    # One gather over several mesh dims puts pieces in the group's (ascending rank) order: fuse only when
    # that is the mesh's row-major order, e.g. not on [[0, 2], [1, 3]].
    in_order = group is not None and list(group[1]) == sorted(group[1])
    if others_touch or not in_order or not is_even(spec.shape, spec.mesh.shape, src):
        return steps
    cur = list(src)
    for s in steps:  # all-to-alls may come first in phase 1; they never touch these dims
        if s.kind == "all_to_all":
            cur[s.mesh_dims[0]] = s.dst[0]
    rest = [s for s in steps if s.kind != "all_gather"]
    return [_step("all_gather", dims, cur, tuple(Replicate() for _ in dims), spec)] + rest


def _reduce_steps(reduces: List[int], cur: List[Placement], dst, spec: DTensorSpec) -> List[Step]:
    """All-reduces for Partial→Replicate (fused per reduce op), then Replicate→Partial where asked."""
    out: List[Step] = []
    by_op = {}
    for m in reduces:
        by_op.setdefault(cur[m].reduce_op, []).append(m)
    for op, dims in by_op.items():
        dims = tuple(dims)
        fused = len(dims) > 1 and spec.mesh.group_for(dims) is not None
        for group in ([dims] if fused else [(m,) for m in dims]):
            out.append(_step("all_reduce", group, cur, tuple(Replicate() for _ in group), spec))
            for m in group:
                cur[m] = Replicate()
    for m in reduces:
        if type(dst[m]) is Partial:
            out.append(_step("to_partial", (m,), cur, (dst[m],), spec))
            cur[m] = dst[m]
    return out


# ---------------------------------------------------------------- execution
def redistribute_local(local: torch.Tensor, src: DTensorSpec, dst_placements: Tuple[Placement, ...], *,
                       async_op: bool = False, owned: bool = False) -> torch.Tensor:
    """Run the cached plan on this rank's shard; return the new shard.

    ``owned=True`` hands ``local`` over: nobody else holds it or any view of it, so it may be
    written in place (an in-place all-reduce) or returned as a view. Leave it False unless
    that is certain: a wrong guess silently changes a tensor someone still uses.

    Example:
        >>> redistribute_local(local, spec, (Replicate(),))  # doctest: +SKIP
    """
    plan = plan_redistribute(src, tuple(dst_placements))
    return run_plan(local, src, plan, async_op=async_op, owned=owned)


def run_plan(local: torch.Tensor, src: DTensorSpec, plan: Plan, *, async_op: bool = False,
             owned: bool = False) -> torch.Tensor:
    """Execute ``plan`` on ``local`` (the shard described by ``src``); ``owned`` as in :func:`redistribute_local`."""
    if 0 in src.tensor_meta.shape:  # nothing to move: just the right empty shard (no numel(): it would specialize symbolic sizes)
        shape, _ = local_shape_and_offset(src.shape, src.mesh.shape, src.mesh._coord, _final(src, plan))
        return local.new_empty(shape)
    if plan.fallback is not None and type(local) is not torch.Tensor and C.is_traced(local):
        plan = plan.fallback  # torch.compile traces the functional collectives, not messages
    cur = list(src.placements)
    last = len(plan.steps) - 1
    for i, step in enumerate(plan.steps):
        local = _RUN[step.kind](local, step, cur, src, owned, async_op and i == last)
        for m, p in zip(step.mesh_dims, step.dst):
            cur[m] = p
        owned = owned or COST_FACTOR[step.kind] > 0
    return local


def _final(src: DTensorSpec, plan: Plan):
    cur = list(src.placements)
    for step in plan.steps:
        for m, p in zip(step.mesh_dims, step.dst):
            cur[m] = p
    return cur


def _parent_len(spec: DTensorSpec, cur, m: int, dim: int) -> int:
    """Extent of ``dim`` that mesh dim ``m`` splits, on this rank (earlier mesh dims applied)."""
    coord = spec.mesh._coord
    before = [p if k < m else Replicate() for k, p in enumerate(cur)]
    return local_shape_and_offset(spec.shape, spec.mesh.shape, coord, before)[0][dim]


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size
    out = buffer_pool.empty(shape, t).zero_() if buffer_pool.plain(t) else t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` (a plain tensor), into a reused buffer where one is free."""
    if not buffer_pool.plain(t):  # traced or not CPU: the usual op, graphs unchanged
        return t.clone(memory_format=torch.contiguous_format)
    return buffer_pool.empty(t.shape, t).copy_(t)


def _run_gather(local, step: Step, cur, spec, owned, async_op):
    if len(step.mesh_dims) > 1:
        return _run_fused_gather(local, step, cur, spec, async_op)
    m = step.mesh_dims[0]
    d = cur[m].dim
    k = spec.mesh.shape[m]
    n = _parent_len(spec, cur, m, d)
    c = -(-n // k)
    piece = _pad_to(wait_all(local), d, c).contiguous()
    if math.prod(piece.shape[:d]) == 1:
        # The gathered buffer already is the tensor (padding sits at the end): views only.
        shape = list(piece.shape)
        shape[d] = n

        def fix(buf, d=d, n=n, shape=piece.shape):
            full = list(shape)
            full[d] = k * c
            return buf.view(full).narrow(d, 0, n)
    else:
        shape = list(piece.shape)
        shape[d] = n

        def fix(buf, d=d, n=n, shape=piece.shape):
            if n == k * c:
                b = buf.view(k, *shape).movedim(0, d)
                merged = list(shape)
                merged[d] = k * c
                if not buffer_pool.plain(buf):
                    return b.reshape(merged)  # the one layout copy
                out = buffer_pool.empty(merged, buf)  # the one layout copy, into a reused buffer
                out.view(b.shape).copy_(b)
                return out
            # Uneven: each rank's piece, padding dropped, straight into the final layout (still one copy).
            final = list(shape)
            final[d] = n
            out = buffer_pool.empty(final, buf)
            pieces = buf.view(k, *shape)
            for r in range(k):
                off, ln = chunk_bounds(n, k, r)
                if ln:
                    out.narrow(d, off, ln).copy_(pieces[r].narrow(d, 0, ln))
            return out
    return C.all_gather(piece, spec.mesh, (m,), async_op=async_op, finish=fix, finish_shape=shape)


def _run_fused_gather(local, step: Step, cur, spec, async_op):
    dims = step.mesh_dims
    piece = wait_all(local).contiguous()
    ks = [spec.mesh.shape[m] for m in dims]
    order = []  # output axes: for each tensor dim, the mesh axes sharding it (outermost first), then itself
    for d in range(piece.ndim):
        order.extend(i for i, m in enumerate(dims) if cur[m].dim == d)
        order.append(len(dims) + d)
    full = list(piece.shape)
    for i, m in enumerate(dims):
        full[cur[m].dim] *= ks[i]

    def fix(buf):
        return buf.view(*ks, *piece.shape).permute(order).reshape(full)
    return C.all_gather(piece, spec.mesh, dims, async_op=async_op, finish=fix, finish_shape=full)


def _run_all_to_all(local, step: Step, cur, spec, owned, async_op):
    m = step.mesh_dims[0]
    i, j = step.src[0].dim, step.dst[0].dim
    k = spec.mesh.shape[m]
    me = spec.mesh._coord[m]
    local = wait_all(local)
    n_i, n_j = spec.shape[i], spec.shape[j]  # no other mesh dim shards i or j (planner's rule)
    rows_j = [chunk_bounds(n_j, k, r) for r in range(k)]
    rows_i = [chunk_bounds(n_i, k, r) for r in range(k)]
    inner = list(local.shape)
    send_sizes = []
    if j == 0 and local.is_contiguous():
        flat_in = local.reshape(-1)
        row = math.prod(local.shape[1:])
        send_sizes = [ln * row for _, ln in rows_j]
    else:
        flat_in = buffer_pool.empty((local.numel(),), local)
        o = 0
        for off, ln in rows_j:
            piece = local.narrow(j, off, ln)
            flat_in[o:o + piece.numel()].view(piece.shape).copy_(piece)
            send_sizes.append(piece.numel())
            o += piece.numel()
    shapes = []
    for _, ln in rows_i:
        s = list(inner)
        s[i] = ln
        s[j] = rows_j[me][1]
        shapes.append(s)
    recv_sizes = [math.prod(s) for s in shapes]
    out_shape = list(inner)
    out_shape[i] = n_i
    out_shape[j] = rows_j[me][1]

    def fix(buf):
        if i == 0:
            return buf.view(out_shape)
        parts = torch.split(buf, recv_sizes)
        views = [p.view(s) for p, s in zip(parts, shapes)]
        if not buffer_pool.plain(buf):
            return torch.cat(views, dim=i)
        return torch.cat(views, dim=i, out=buffer_pool.empty(out_shape, buf))
    return C.all_to_all(flat_in, spec.mesh, (m,), recv_sizes, send_sizes, async_op=async_op, finish=fix,
                        finish_shape=out_shape)


def _run_reduce_scatter(local, step: Step, cur, spec, owned, async_op):
    m = step.mesh_dims[0]
    d = step.dst[0].dim
    k = spec.mesh.shape[m]
    me = spec.mesh._coord[m]
    n = _parent_len(spec, cur, m, d)
    c = -(-n // k)
    _, ln = chunk_bounds(n, k, me)
    x = _pad_to(wait_all(local), d, k * c)
    pre, post = list(x.shape[:d]), list(x.shape[d + 1:])
    # The k chunks of dim d stacked on dim 0 (one copy when d != 0): the collective's output is
    # then this rank's chunk already laid out as the final shard, with no copy after it.
    buf = x.reshape(pre + [k, c] + post).movedim(d, 0)
    if d and buffer_pool.plain(buf):
        buf = _copy(buf)  # the one pack copy, into a reused buffer
    final = list(local.shape)
    final[d] = ln

    def fix(out):
        res = out.view(pre + [c] + post).narrow(d, 0, ln)
        return res if res.is_contiguous() else _copy(res)  # uneven: drop the padding
    return C.reduce_scatter(buf, spec.mesh, (m,), step.src[0].reduce_op, async_op=async_op, finish=fix,
                            finish_shape=final)


def _run_all_reduce(local, step: Step, cur, spec, owned, async_op):
    return C.all_reduce(local, spec.mesh, step.mesh_dims, step.src[0].reduce_op, async_op=async_op, inplace=owned)


def _run_chunk(local, step: Step, cur, spec, owned, async_op):
    m = step.mesh_dims[0]
    d = step.dst[0].dim
    n = _parent_len(spec, cur, m, d)
    off, ln = chunk_bounds(n, spec.mesh.shape[m], spec.mesh._coord[m])
    local = wait_all(local)
    piece = local.narrow(d, off, ln)
    # Never hand back a view of the caller's tensor: an in-place op on the new shard would
    # silently change the replicated original. A view of a tensor we own (a gathered buffer, a
    # temporary handed over) is safe, but it keeps all of that memory alive: only where the
    # piece is at least half of it.
    if owned and piece.is_contiguous() and 2 * piece.numel() >= local.numel():
        return piece
    return _copy(piece)


def _run_to_partial(local, step: Step, cur, spec, owned, async_op):
    m = step.mesh_dims[0]
    if step.dst[0].reduce_op == "sum" and spec.mesh._coord[m] != 0:
        return torch.zeros_like(wait_all(local))
    return local if owned else _copy(wait_all(local))


def _run_p2p(local, step: Step, cur, spec, owned, async_op):
    return permute.run_p2p(local, spec, step.src, step.dst, owned, async_op)


_RUN = {
    "p2p": _run_p2p,
    "all_gather": _run_gather,
    "all_to_all": _run_all_to_all,
    "reduce_scatter": _run_reduce_scatter,
    "all_reduce": _run_all_reduce,
    "chunk": _run_chunk,
    "to_partial": _run_to_partial,
}


def transition_cost(src: Placement, dst: Placement, local_bytes: float, k: int) -> float:
    """Cost of changing one mesh dim's placement (same table as the planner); 0 if equal.

    Used to price strategy candidates per mesh dim before any full plan is made.

    Example:
        >>> transition_cost(Shard(0), Replicate(), 1024, 4)
        7168.0
    """
    if src == dst:
        return 0.0
    if k == 1:
        return 0.5  # free relabel, but keeping the input as it is wins ties
    ts, td = type(src), type(dst)
    if ts is Replicate:
        return 1.0 if td is Shard else 2.0  # local work only; prefer no change at all
    if ts is Shard:
        if td is Shard:
            kind, moved = "all_to_all", local_bytes * (k - 1) / k
        else:  # gather (then a local step to Partial)
            kind, moved = "all_gather", local_bytes * (k - 1)
    elif td is Shard:
        kind, moved = "reduce_scatter", local_bytes * (k - 1) / k
    else:
        kind, moved = "all_reduce", local_bytes * (k - 1) / k
    return COST_FACTOR[kind] * moved + LATENCY
