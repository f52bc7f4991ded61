"""explain() and explicit(): seeing, and forbidding, the communication ops cause.

``with explain() as ex`` records every op call: its input placements, every
candidate strategy with its cost, the one chosen, and each redistribution that
was inserted (collective and bytes). The eager fast paths (TP styles' local
matmuls and lookups, sequence-parallel norms, the coalesced gradient all-reduce)
report their local op and the collectives they issued through the same hook
(records with ``is_fast_path``). ``with explicit("raise")`` turns any
redistribution the user did not ask for into an error (or a warning).
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import List

from shardprop.dispatch import hooks as _hooks


@dataclass(frozen=True)
class OpRecord:
    """One op call as seen by the dispatcher."""

    op: str
    inputs: tuple           # placements of each DTensor input
    needed: tuple           # placements the chosen strategy needs
    outputs: tuple          # placements of each output (None for non-tensor outputs)
    candidates: tuple       # Candidate(mesh_dim, inputs, outputs, cost)
    redistributions: tuple  # (input index, from, to, plan steps)
    fast: tuple = ()        # a fast path's own collectives: (kind, mesh dims, bytes); empty for dispatcher ops
    what: str = ""          # for a fast path: which one, and on which module

    @property
    def collectives(self) -> List[tuple]:
        """(input index, kind, mesh dims, bytes) for every collective inserted (index 0 for a fast path's)."""
        return [(i, s.kind, s.mesh_dims, s.bytes) for i, _, _, plan in self.redistributions
                for s in plan.collectives] + [(0, kind, dims, nbytes) for kind, dims, nbytes in self.fast]

    @property
    def is_fast_path(self) -> bool:
        """Whether an eager fast path ran this (local op on local tensors), not the dispatcher."""
        return bool(self.what)


class Explanation:
    """The records of one ``explain()`` block; ``print(ex)`` shows them as a table."""

    def __init__(self):
        self.records: List[OpRecord] = []
        self.notes: List[str] = []  # decisions made outside op dispatch (context-parallel attention's method)

    def note(self, text: str) -> None:
        """Record a decision taken outside op dispatch; ``print(ex)`` lists the notes after the table."""
        self.notes.append(text)

    def record(self, schema, out) -> None:
        specs = schema.specs
        redis = tuple((i, s.placements, need.placements, plan)
                      for i, (s, need, plan) in enumerate(zip(specs, out.in_specs, out.plans)) if plan is not None)
        self.records.append(OpRecord(
            str(schema.op), tuple(s.placements for s in specs), tuple(s.placements for s in out.in_specs),
            tuple(None if s is None else s.placements for s in out.out_specs), out.candidates, redis))

    def record_fast(self, op: str, what: str, inputs: tuple, outputs: tuple, collectives: tuple) -> None:
        """A fast path's local op (``linear (local)``, ...) and the collectives it issued (kind, mesh dims, bytes)."""
        self.records.append(OpRecord(op, tuple(inputs), tuple(inputs), tuple(outputs), (), (), tuple(collectives),
                                     what))

    def __len__(self) -> int:
        return len(self.records)

    def __str__(self) -> str:
        from tabulate import tabulate
        rows = []
        for r in self.records:
            redis = "; ".join(
                f"in{i} {_pl(a)}->{_pl(b)}: " + ", ".join(f"{s.kind}@{list(s.mesh_dims)} {s.bytes}B" for s in p.steps)
                for i, a, b, p in r.redistributions) or "-"
            if r.fast:
                redis = "; ".join(f"{k}@{list(d)} {n}B" for k, d, n in r.fast)
            if r.what:
                rows.append([r.op, " ".join(_pl(p) for p in r.inputs), _chosen(r), redis, r.what])
                continue
            rows.append([r.op, " ".join(_pl(p) for p in r.inputs), _chosen(r), redis, _alternatives(r)])
        table = tabulate(rows, headers=["op", "inputs", "chosen (needs -> gives)", "redistributions",
                                        "candidates (cost)"])
        return "\n".join([table] + self.notes) if self.notes else table

    __repr__ = __str__


def _pl(placements) -> str:
    if placements is None:
        return "-"
    return "[" + ",".join(repr(p) for p in placements) + "]"


def _chosen(r: OpRecord) -> str:
    return " ".join(_pl(p) for p in r.needed) + " -> " + " ".join(_pl(p) for p in r.outputs)


def _alternatives(r: OpRecord, limit: int = 4) -> str:
    """The cheapest few candidates per mesh dim, so a reader sees why the winner won."""
    parts = []
    by_dim = {}
    for c in r.candidates:
        by_dim.setdefault(c.mesh_dim, []).append(c)
    for m, cands in by_dim.items():
        cands = sorted(cands, key=lambda c: c.cost)[:limit]
        label = f"m{m}" if m >= 0 else "all"
        parts.append(f"{label}: " + ", ".join(
            f"{_pl(c.inputs)}->{_pl(c.outputs)}={c.cost:.0f}" for c in cands))
    return " | ".join(parts)


@contextlib.contextmanager
def explain():
    """Record every op call in the block, with strategies, costs and redistributions.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> x = distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)])
        >>> w = distribute_tensor(torch.randn(16, 4), mesh, [Replicate()])
        >>> with shardprop.explain() as ex:
        ...     y = x @ w
        >>> [r.op for r in ex.records]
        ['aten.mm.default']
        >>> print(ex)
        op...inputs...chosen (needs -> gives)...redistributions...candidates (cost)
        ...
        aten.mm.default...[S(0)] [R]...[S(0)] [R] -> [S(0)]...
    """
    ex = Explanation()
    prev = _hooks.set_recorder(ex)
    try:
        yield ex
    finally:
        _hooks.set_recorder(prev)


class ImplicitRedistributionError(RuntimeError):
    """An op needed a redistribution inside ``explicit("raise")``.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> x = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
        >>> y = distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)])
        >>> with explicit("raise"):
        ...     try:
        ...         x + y
        ...     except ImplicitRedistributionError as e:
        ...         print(str(e)[:55])
        aten.add.Tensor needs an implicit redistribution: input
    """


@contextlib.contextmanager
def explicit(mode: str = "raise"):
    """Make implicit redistributions (ones not asked for with ``.redistribute``) an error or a warning.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> x_s0 = distribute_tensor(torch.ones(8, 8), mesh, [Shard(0)])
        >>> x_s1 = distribute_tensor(torch.ones(8, 8), mesh, [Shard(1)])
        >>> with shardprop.explicit("raise"):
        ...     y = x_s0 + x_s1.redistribute(placements=[Shard(0)])   # asked for: fine
        ...     y = x_s0 + x_s1   # raises: aten.add.Tensor needs in1 [S(1)]->[S(0)]
        Traceback (most recent call last):
        ...
        shardprop.debug.explain.ImplicitRedistributionError: aten.add.Tensor needs an implicit redistribution: ...
    """
    if mode not in ("raise", "warn"):
        raise ValueError(f"explicit: mode must be 'raise' or 'warn', got {mode!r}")

    def guard(schema, out):
        moves = []
        for i, (have, need, plan) in enumerate(zip(schema.specs, out.in_specs, out.plans)):
            if plan is not None:
                kinds = ", ".join(s.kind for s in plan.steps)
                moves.append(f"input {i} {_pl(have.placements)} -> {_pl(need.placements)} ({kinds})")
        msg = f"{schema.op} needs an implicit redistribution: " + "; ".join(moves)
        if mode == "raise":
            raise ImplicitRedistributionError(msg + ". Redistribute the inputs explicitly first.")
        warnings.warn(msg, stacklevel=4)

    prev = _hooks.set_explicit_mode(guard)
    try:
        yield
    finally:
        _hooks.set_explicit_mode(prev)
