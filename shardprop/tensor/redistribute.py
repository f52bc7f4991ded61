"""Redistribution: plan the collectives between two placement lists, then run them.

Planning is per mesh dim (table in docs/design/op-path.md) and cached per (source spec,
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
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from shardprop.mesh import collectives as C
from shardprop.tensor import permute
from shardprop.tensor import steps as steps_mod
from shardprop.tensor.layout import is_even
from shardprop.tensor.placement import Partial, Placement, Replicate, Shard, _StridedShard, has_strided, is_shard_like
from shardprop.tensor.spec import DTensorSpec

# Relative cost per byte each rank moves, by collective (ring algorithms);
# LATENCY is a fixed cost per collective, in byte-equivalents.
COST_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0, "all_reduce": 2.0,
               "p2p": permute.P2P_FACTOR, "chunk": 0.0, "to_partial": 0.0,
               # _StridedShard's moves (strided_steps.py): a padded all-gather and reorder, a local pick.
               "strided_gather": 1.0, "strided_chunk": 0.0}
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
    # One slot: the plan prepared for its source spec (steps.Program), filled on first eager run.
    prepared: list = field(default_factory=lambda: [None], compare=False, hash=False, repr=False)

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
        if is_shard_like(p):
            numel /= spec.mesh.shape[m]
    return numel * spec.dtype.itemsize


def _step(kind: str, dims, cur: List[Placement], dst, spec: DTensorSpec) -> Step:
    dims = tuple(dims)
    k = math.prod(spec.mesh.shape[m] for m in dims)
    if kind in ("all_gather", "strided_gather"):
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


def _changed_by_dim(src, dst) -> List[bool]:
    """As :func:`_changed`, with ``_StridedShard``: a shard is redone when an earlier mesh dim
    sharding the same tensor dim (plainly or strided) changes."""
    out = []
    for m, (s, t) in enumerate(zip(src, dst)):
        ch = s != t
        if not ch and is_shard_like(s):
            ch = any(out[k] and any(is_shard_like(p) and p.dim == s.dim for p in (src[k], dst[k])) for k in range(m))
        out.append(ch)
    return out


def _strided_plan(src: DTensorSpec, dst_placements: Tuple[Placement, ...]) -> Plan:
    """The plan when either side holds a ``_StridedShard``: simple and correct before fast.

    Phase 1 gathers every shard that changes, innermost mesh dim first (a strided one by
    ``strided_gather``: all-gather then reorder), so each gather sees its parent; phase 2
    builds the target outermost first (local chunks and picks, reduce-scatters for
    ``Partial -> Shard``, all-reduces). No all-to-all, fused or point-to-point moves.
    """
    n = len(dst_placements)
    dst = list(dst_placements)
    cur = [dst[m] if src.mesh.shape[m] == 1 else p for m, p in enumerate(src.placements)]
    changed = _changed_by_dim(cur, dst)
    steps: List[Step] = []
    for m in reversed(range(n)):
        s = cur[m]
        if changed[m] and is_shard_like(s):
            steps.append(_step("strided_gather" if type(s) is _StridedShard else "all_gather", (m,), cur,
                               (Replicate(),), src))
            cur[m] = Replicate()
    return _build_target(steps, cur, dst, src)


def _build_target(steps: List[Step], cur: list, dst: list, src: DTensorSpec) -> Plan:
    """Phase 2 of both planners, after the gathers: build the target outermost first (local chunks and
    strided picks, reduce-scatters for ``Partial -> Shard``); all-reduces wait till the end. The plan and its price.
    """
    reduces: List[int] = []
    for m in range(len(dst)):
        s, t = cur[m], dst[m]
        if s == t:
            continue
        if type(s) is Partial:
            if type(t) is Shard:
                steps.append(_step("reduce_scatter", (m,), cur, (t,), src))
                cur[m] = t
            elif type(t) is _StridedShard:  # reduce whole, then pick (no strided reduce-scatter)
                steps.append(_step("all_reduce", (m,), cur, (Replicate(),), src))
                cur[m] = Replicate()
                steps.append(_step("strided_chunk", (m,), cur, (t,), src))
                cur[m] = t
            else:  # to Replicate, or to another reduce op (reduce fully, then re-partial)
                reduces.append(m)
            continue
        kind = "chunk" if type(t) is Shard else "strided_chunk" if type(t) is _StridedShard else "to_partial"
        steps.append(_step(kind, (m,), cur, (t,), src))
        cur[m] = t
    steps.extend(_reduce_steps(reduces, cur, dst, src))
    steps_t = tuple(steps)
    cost = sum(COST_FACTOR[s.kind] * s.bytes + (LATENCY if COST_FACTOR[s.kind] else 0) for s in steps_t)
    return Plan(steps_t, cost)


@functools.lru_cache(maxsize=4096)
def plan_redistribute(src: DTensorSpec, dst_placements: Tuple[Placement, ...]) -> Plan:
    """The cached plan that turns ``src`` into ``dst_placements`` on the same mesh.

    Example:
        >>> x = distribute_tensor(torch.ones(8), init_device_mesh("cpu", (4,)), [Shard(0)])
        >>> plan_redistribute(x._spec, (Replicate(),)).steps
        (all_gather@[0]: [S(0)]->[R] (...),)
    """
    if has_strided(src.placements) or has_strided(dst_placements):  # a miss only: the plan is cached
        return _strided_plan(src, dst_placements)
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
    plan = _build_target(steps, cur, dst, src)
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
    # No coordinate is needed: ranks outside the mesh price (and so choose) as its members do.
    if cur == dst or not permute.eligible(src.shape, cur, dst, mesh.size()):
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
    # One gather over several mesh dims puts pieces in the group's (ascending rank) order: fuse only when
    # that is the mesh's row-major order, e.g. not on [[0, 2], [1, 3]].
    in_order = spec.mesh.group_in_order(dims)
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
# (source spec, target placements) -> the prepared program for eager local tensors. A repeated
# redistribution (the same layout change every training step: tensor-parallel sequence gathers
# and reduce-scatters, their backward) then costs one dict lookup and one shape comparison
# before the step's own tensor work. Filled for eager tensors of interned specs only.
_READY: dict = {}
_READY_MAX = 4096


def redistribute_local(local: torch.Tensor, src: DTensorSpec, dst_placements: Tuple[Placement, ...], *,
                       async_op: bool = False, owned: bool = False) -> torch.Tensor:
    """Run the cached plan on this rank's shard; return the new shard.

    ``owned=True`` hands ``local`` over: nobody else holds it or any view of it, so it may be
    written in place (an in-place all-reduce) or returned as a view. Leave it False unless
    that is certain: a wrong guess silently changes a tensor someone still uses.

    Example:
        >>> redistribute_local(local, spec, (Replicate(),))  # doctest: +SKIP
    """
    if type(dst_placements) is not tuple:
        dst_placements = tuple(dst_placements)
    prog = _READY.get((src, dst_placements))
    if prog is not None and type(local) is torch.Tensor and local.shape == prog.in_shape:
        return prog.call(local, owned, async_op)
    if src.mesh._coord is None:  # outside the mesh (torch's semantics): nothing to move, the empty shard stays
        return local
    plan = plan_redistribute(src, dst_placements)
    prog = program_of(local, src, plan)
    if type(local) is torch.Tensor and not src.is_symbolic:
        if len(_READY) >= _READY_MAX:
            _READY.clear()
        _READY[(src, dst_placements)] = prog
    return prog.call(local, owned, async_op)


def program_of(local: torch.Tensor, src: DTensorSpec, plan: Plan) -> steps_mod.Program:
    """The prepared program of ``plan`` for ``local`` (kept on the plan for eager tensors).

    Example:
        >>> program_of(local, spec, plan).wants_owned  # doctest: +SKIP
        False
    """
    if type(local) is not torch.Tensor and C.is_traced(local):
        if plan.fallback is not None:  # torch.compile traces the functional collectives, not messages
            plan = plan.fallback
        return steps_mod.prepare(src, plan, local.shape)  # per trace, as the arithmetic always ran
    prog = plan.prepared[0]
    if prog is not None and prog.src is src and prog.in_shape == local.shape:
        return prog
    prog = steps_mod.prepare(src, plan, local.shape)
    plan.prepared[0] = prog
    return prog


def run_plan(local: torch.Tensor, src: DTensorSpec, plan: Plan, *, async_op: bool = False,
             owned: bool = False) -> torch.Tensor:
    """Execute ``plan`` on ``local`` (the shard described by ``src``); ``owned`` as in :func:`redistribute_local`.

    Example:
        >>> run_plan(local, spec, plan_redistribute(spec, (Replicate(),)))  # doctest: +SKIP
    """
    prog = plan.prepared[0]
    if prog is None or prog.src is not src or type(local) is not torch.Tensor or local.shape != prog.in_shape:
        prog = program_of(local, src, plan)
    return prog.call(local, owned, async_op)


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
        return 1.0 if td is Shard or td is _StridedShard else 2.0  # local work only; prefer no change at all
    if ts is Shard or ts is _StridedShard:
        if td is Shard and ts is Shard:
            kind, moved = "all_to_all", local_bytes * (k - 1) / k
        else:  # gather (then a local step to Partial)
            kind, moved = "all_gather", local_bytes * (k - 1)
    elif td is Shard:
        kind, moved = "reduce_scatter", local_bytes * (k - 1) / k
    else:
        kind, moved = "all_reduce", local_bytes * (k - 1) / k
    return COST_FACTOR[kind] * moved + LATENCY
