"""Check a sharding rule against the op itself, for every input layout of a sample call.

For each combination of input placements the rule in force is asked what it would
do, then the op is run on real shards:

* the rule takes the inputs as they are: the result must equal the op on the full
  sample ("accepted"), else the rule is wrong ("incorrect");
* the rule would redistribute (with communication) or the engine refuses the layout:
  if the op run on the local shards as they are gives the right answer under some
  output placement, the rule misses a cheaper option ("missing"); otherwise the
  combination is counted as "redistributed" or listed as "rejected" (ShardingError);
* the rule raises anything else, or the op fails on a layout the rule accepted: "errors".

"missing" is judged on the sample: an option that is right only for some values (a
scalar's sign, say) can show up; "incorrect" is a counterexample, always a bug.

How the check stays honest:

* Inputs hold values whose *reduction* is the sample: a ``Partial("sum")`` input is
  random parts that add up, ``max`` has the true value on one rank (a different
  one per element) and smaller values elsewhere, so a rule that confuses reductions
  is caught.
* By default the sample's floating tensors are replaced by non-round values of both
  signs (positive only if the sample is non-negative), so linear-looking identities
  such as ``relu(a + b) == relu(a) + relu(b)`` do not hold by accident.
* The global value of an output layout is rebuilt from every rank's local piece by
  the definition of the placements, not by the engine's redistribution, so a bug
  there cannot hide a rule bug (and a "replicated" output must agree on every rank).
* It is collective: every rank checks the first mesh rank's sample (one broadcast at
  the start, as ``distribute_tensor`` takes ``src_data_rank=0``'s data), walks the same
  combinations in the same order, and the only other communication is one all-gather
  of local results per batch, whatever happens on any rank (errors included), so a
  failure cannot leave ranks waiting.
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from shardprop.debug.check_layouts import (
    correct_layouts,
    local_input,
    map_tensors,
    perturbed,
    placement_options,
    seeded,
)
from shardprop.debug.check_out import build_schema, out_dtensors
from shardprop.dispatch import propagate as _prop
from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.placement import Placement

_BATCH = 64  # combinations per all-gather of local results


# ---------------------------------------------------------------- report
@dataclass(frozen=True)
class Finding:
    """One input layout and what happened to it.

    ``inputs``: one placement tuple (one entry per mesh dim) per DTensor argument.
    ``outputs``: per tensor output, the rule's placements (accepted, incorrect) or the
    first placements found correct for the local results (missing); None for a
    non-tensor output. ``correct``: per output, every placement tuple found correct
    (missing, and incorrect as a hint; empty when none is). ``rule_inputs``: what the
    rule would redistribute the inputs to (missing). ``cost``: that redistribution's cost
    (inf when the engine rejects the layout). ``message``: what went wrong, if anything.
    """

    inputs: Tuple[Tuple[Placement, ...], ...]
    outputs: Tuple[Optional[Tuple[Placement, ...]], ...] = ()
    correct: Tuple[Tuple[Tuple[Placement, ...], ...], ...] = ()
    rule_inputs: Tuple[Tuple[Placement, ...], ...] = ()
    cost: float = 0.0
    message: str = ""

    def __str__(self) -> str:
        return f"{_fmt_inputs(self.inputs)} -> {_fmt_outputs(self.outputs)}"


@dataclass
class RuleReport:
    """What ``check_sharding_rule`` found. ``ok`` is True when no combination is incorrect.

    Lists of :class:`Finding`: ``incorrect`` (accepted as is, wrong result), ``missing``
    (moved or refused, though running as is would be right), ``accepted`` (as is, right),
    ``errors`` (the rule crashed, or the op failed on an accepted layout), ``rejected``
    (ShardingError, and running as is would not be right); ``redistributed`` counts the rest.

    Example:
        >>> a, b = torch.randn(8, 6), torch.randn(6, 4)
        >>> report = shardprop.check_sharding_rule(torch.ops.aten.mm.default, a, b, mesh=init_device_mesh("cpu", (4,)))
        >>> report.ok, len(report.missing)
        (True, 0)
        >>> print(report)  # doctest: +SKIP
    """

    op: Any
    mesh_shape: Tuple[int, ...]
    arg_names: Tuple[str, ...]
    total: int                # input combinations there are
    checked: int              # ... and how many were checked
    incorrect: List[Finding] = field(default_factory=list)
    missing: List[Finding] = field(default_factory=list)
    accepted: List[Finding] = field(default_factory=list)
    errors: List[Finding] = field(default_factory=list)
    rejected: List[Finding] = field(default_factory=list)  # the engine refuses the layout (ShardingError)
    redistributed: int = 0    # the rule redistributes, and running as is would be wrong (or saves no communication)
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.incorrect

    def find(self, kind: str, inputs, outputs=None) -> Optional[Finding]:
        """The finding of ``kind`` ("incorrect", "missing", ...) for ``inputs`` (and ``outputs``).

        Placements may be given as single Placements (one per DTensor argument; on a
        1-d mesh) or as per-mesh-dim tuples; a single output needs no tuple.

        Example:
            >>> report.find("missing", (Shard(0), Replicate()), Shard(0))  # doctest: +SKIP
        """
        want_in = tuple(_as_layout(p) for p in inputs)
        want_out = None
        if outputs is not None:
            # One output: a Placement (1-d mesh) or one Placement per mesh dim; else one entry per output.
            one = isinstance(outputs, Placement) or (len(self.mesh_shape) > 1 and _is_layout(outputs))
            outs = (outputs,) if one else tuple(outputs)
            want_out = tuple(None if o is None else _as_layout(o) for o in outs)
        for f in getattr(self, kind):
            if f.inputs != want_in:
                continue
            if want_out is None or f.outputs == want_out:
                return f
            # missing/incorrect: any correct alternative counts
            if f.correct and len(f.correct) == len(want_out) and all(
                    w is None or w in alts for w, alts in zip(want_out, f.correct)):
                return f
        return None

    def summary(self) -> str:
        checked = f"{self.checked} input combinations" if self.checked == self.total else \
            f"{self.checked} of {self.total} input combinations (deterministic sample)"
        return (f"{self.op} on mesh {self.mesh_shape}, args {', '.join(self.arg_names)}: {checked}: "
                f"{len(self.accepted)} accepted, {len(self.incorrect)} INCORRECT, {len(self.missing)} missing, "
                f"{len(self.errors)} errors, {len(self.rejected)} rejected, {self.redistributed} redistributed")

    def __str__(self) -> str:
        from tabulate import tabulate
        rows = []
        for kind in ("incorrect", "missing", "errors", "rejected", "accepted"):
            for f in getattr(self, kind):
                if kind == "incorrect":
                    alts = "; ".join(_fmt_outputs(c) for c in _combos_of(f.correct)) or "none found"
                    note = f"{f.message}; correct output: {alts}"
                elif kind == "missing" and f.rule_inputs:
                    note = f"rule redistributes to {_fmt_inputs(f.rule_inputs)} (cost {f.cost:g})"
                else:
                    note = f.message
                out = _fmt_outputs(f.outputs) if f.outputs else ""
                rows.append((kind, _fmt_inputs(f.inputs), out, _short(note)))
        table = tabulate(rows, headers=("kind", "inputs", "outputs", "note")) if rows else "(no combinations)"
        return "\n".join([table, *self.notes, self.summary()])


def _combos_of(correct):
    """The first few combinations of per-output alternatives, for display."""
    return list(itertools.islice(itertools.product(*correct), 3))


def _short(s: str, n: int = 160) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def _is_layout(x) -> bool:
    return isinstance(x, (tuple, list)) and len(x) > 0 and all(isinstance(p, Placement) for p in x)


def _as_layout(p) -> Tuple[Placement, ...]:
    return (p,) if isinstance(p, Placement) else tuple(p)


def _fmt_layout(pl) -> str:
    if pl is None:
        return "-"
    return repr(pl[0]) if len(pl) == 1 else "[" + ", ".join(map(repr, pl)) + "]"


def _fmt_inputs(ins) -> str:
    body = ", ".join(_fmt_layout(p) for p in ins)
    return f"({body},)" if len(ins) == 1 else f"({body})"


def _fmt_outputs(outs) -> str:
    return _fmt_layout(outs[0]) if len(outs) == 1 else "(" + ", ".join(_fmt_layout(o) for o in outs) + ")"


# ---------------------------------------------------------------- enumeration
def _select(n: int, cap: Optional[int], rng: random.Random) -> List[int]:
    """Indices of the items to keep: all, or a deterministic sample of ``cap`` in order.

    Item 0 (all Replicate, the layout every rule should take as is) is always kept.
    """
    if cap is None or n <= cap:
        return list(range(n))
    if cap < 1:
        raise ValueError(f"check_sharding_rule: a cap of {cap} leaves nothing to check")
    return [0] + sorted(rng.sample(range(1, n), cap - 1))


def _enumerate(layouts: List[List[tuple]], max_combos: Optional[int], rng: random.Random):
    """(total count, chosen combinations as tuples of per-arg layouts), without building all of them."""
    sizes = [len(l) for l in layouts]
    total = math.prod(sizes)
    chosen = []
    for idx in _select(total, max_combos, rng):
        combo = []
        for size, ls in zip(reversed(sizes), reversed(layouts)):  # mixed radix, last arg fastest
            idx, r = divmod(idx, size)
            combo.append(ls[r])
        chosen.append(tuple(reversed(combo)))
    return total, chosen


# ---------------------------------------------------------------- running one combination
def _flat_outputs(res) -> list:
    return list(res) if isinstance(res, (tuple, list)) else [res]


def _pack(t):
    """A tensor as (dtype, shape, raw bytes): pickles much faster than a tensor does."""
    if not isinstance(t, torch.Tensor):
        return None
    t = t.detach().cpu().contiguous()
    return t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _unpack(packed):
    if packed is None:
        return None
    dtype, shape, raw = packed
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def _run_combo(op, sample_args, sample_kwargs, combo, mesh, local_of):
    """Ask the rule, run locally. Returns (verdict info, payload to gather); never communicates.

    info is (kind, OutputSharding or error text, output placements): kind "accepted" (the
    rule takes the inputs as they are: run through dispatch), "redistributed" or "rejected"
    (propagation raised ShardingError: run the op on the shards as they are), or "crashed"
    (the rule raised something else: nothing to run).
    """
    it = iter(range(len(combo)))

    def to_dtensor(t):
        if not _is_slot(t):
            return t
        i = next(it)
        return DTensor.from_local(local_of(i, combo[i]), mesh, combo[i], shape=t.shape, stride=t.stride())

    written = _prop.written_kwargs(op)
    dt_args = map_tensors(sample_args, to_dtensor)
    dt_kwargs = {k: v if k in written else map_tensors(v, to_dtensor) for k, v in sample_kwargs.items()}
    try:
        if any(k in written for k in dt_kwargs):
            dt_kwargs = out_dtensors(op, dt_args, dt_kwargs, [k for k in dt_kwargs if k in written], mesh)
        sharding = _prop._propagate_uncounted(build_schema(op, dt_args, dt_kwargs))
        kind = "redistributed" if sharding.needs_redistribute else "accepted"
    except _prop.ShardingError as e:  # the engine refuses this layout: the same on every rank
        sharding, kind = f"{type(e).__name__}: {e}", "rejected"
    except Exception as e:  # a bug in the rule
        return ("crashed", f"{type(e).__name__}: {e}", None), None
    placements = None
    try:
        if kind == "accepted":  # the real path: dispatch, which must not redistribute
            res = _flat_outputs(op(*dt_args, **dt_kwargs))
            outs = [r._local_tensor if isinstance(r, DTensor) else r for r in res]
            placements = tuple(r._spec.placements if isinstance(r, DTensor) else None for r in res)
        else:  # what running on the shards as they are would give
            # out= targets: empty, so the op sizes them for the shards without a resize warning
            unwrap = lambda a: a._local_tensor if isinstance(a, DTensor) else a  # noqa: E731
            dt_kwargs = {k: map_tensors(v, _unsized) if k in written else v
                         for k, v in dt_kwargs.items()}
            outs = _flat_outputs(op(*map_tensors(dt_args, unwrap),
                                    **{k: map_tensors(v, unwrap) for k, v in dt_kwargs.items()}))
        payload = ("ok", [_pack(o) for o in outs])
    except Exception as e:
        payload = ("err", f"{type(e).__name__}: {e}")
    return (kind, sharding, placements), payload


def _run_combo_safely(*args):
    # Whatever goes wrong here, this rank must still reach the batch's all-gather.
    try:
        return _run_combo(*args)
    except Exception as e:
        return ("crashed", f"{type(e).__name__}: {e}", None), None


def _unsized(t) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device=t.device)


def _is_slot(t) -> bool:
    return isinstance(t, torch.Tensor) and t.ndim > 0


# ---------------------------------------------------------------- public entry point
def check_sharding_rule(op, *sample_args, mesh=None, atol: float = 1e-5, rtol: float = 1e-4, perturb: bool = True,
                        seed: int = 0, max_combos: Optional[int] = 2000, max_per_arg: Optional[int] = None,
                        input_layouts: Optional[Sequence] = None, **sample_kwargs) -> RuleReport:
    """Check the sharding rule in force for ``op`` on every input layout of a sample call.

    Collective: call it on every rank of ``mesh`` (default: a 1-d mesh over the world).
    The sample is the first mesh rank's (rank 0 on a mesh over the world): its arguments
    are broadcast and every rank checks those, as ``distribute_tensor`` takes
    ``src_data_rank=0``'s data, so each rank may pass its own unseeded ``torch.randn``
    (its values are then ignored off rank 0). Every tensor argument with at least
    one dim becomes a DTensor, tried with each of R, S(d) for each dim and (floating
    point only) P(sum), P(avg), P(max), P(min) on each mesh dim; 0-dim tensors stay
    plain (dispatch treats them as replicated scalars). ``max_per_arg`` /
    ``max_combos`` cap the layouts per argument / the combinations in all by a
    deterministic sample (``seed``), and the report says so; ``input_layouts`` checks
    just the given combinations (one entry per DTensor argument: a Placement on a 1-d
    mesh, else a tuple with one per mesh dim). With ``perturb`` (default) floating
    samples are replaced by non-round values of the same shape, strides and dtype
    with both signs (positive only if the sample is non-negative); pass
    ``perturb=False`` for ops that need values in a narrower domain. The op must be
    deterministic. Other keyword arguments are the op's; tensors in the ones it writes
    (``out=``, ``min=``/``min_indices=`` of ``aten.min.dim_min``) are not inputs: each
    combination gives them the placements the rule gives the outputs, and the values
    written are what is checked.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> a, b = torch.randn(8, 6), torch.randn(6, 4)  # rank 0's are used on every rank
        >>> r = check_sharding_rule(torch.ops.aten.mm.default, a, b, mesh=mesh)
        >>> r.ok, r.find("accepted", (Shard(0), Replicate()), Shard(0)) is not None
        (True, True)
        >>> print(r)  # a table of every finding and a summary line  # doctest: +SKIP
    """
    if mesh is None:
        from shardprop.mesh import init_device_mesh
        cuda = any(t.is_cuda for t in _leaves((sample_args, sample_kwargs)))
        mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    if mesh._coord is None:
        raise RuntimeError(f"check_sharding_rule: this rank is not in {mesh}")
    entry = mesh.group_for(tuple(range(mesh.ndim)))
    if entry is None or entry[0] is None:
        raise RuntimeError(f"check_sharding_rule: {mesh} has no group over all its dims on this rank")
    group = entry[0]
    mesh_shape = tuple(mesh.shape)
    coord = tuple(mesh._coord)
    sample_args, sample_kwargs = _first_ranks_sample(sample_args, sample_kwargs, mesh, entry[1][0], group)

    # The sample (perturbed the same way on every rank) and the reference result.
    counter = itertools.count()
    if perturb:
        fix = lambda t: perturbed(t, seeded(seed, "sample", next(counter)))  # noqa: E731
    else:
        fix = lambda t: t.detach().clone()  # noqa: E731
    sample_args = map_tensors(tuple(sample_args), fix)
    sample_kwargs = {k: map_tensors(v, fix) for k, v in sample_kwargs.items()}
    written = _prop.written_kwargs(op)
    read_kwargs = {k: v for k, v in sample_kwargs.items() if k not in written}
    slots = [t for t in _leaves((sample_args, read_kwargs)) if _is_slot(t)]
    if not slots:
        raise ValueError("check_sharding_rule: the sample has no tensor argument with a dim to distribute")
    clone = lambda t: t.clone()  # noqa: E731  (in-place ops must not change the sample)
    refs = _flat_outputs(op(*map_tensors(sample_args, clone),
                            **{k: map_tensors(v, clone) for k, v in sample_kwargs.items()}))

    names = _slot_names(sample_args, read_kwargs)
    if input_layouts is not None:
        combos = [tuple(_as_layout(p) for p in c) for c in input_layouts]
        bad = [c for c in combos if len(c) != len(slots) or any(len(l) != mesh.ndim for l in c)]
        if bad:
            raise ValueError(f"check_sharding_rule: input layout {bad[0]} does not give one placement per mesh dim "
                             f"for each of the {len(slots)} DTensor arguments {names}")
        total, notes = len(combos), []
    else:
        total, combos, notes = _plan_combos(slots, names, mesh.ndim, max_per_arg, max_combos, seed)
    in_place = _prop._op_alias(op) == "self"

    cache: Dict[tuple, torch.Tensor] = {}

    def local_of(i, layout):
        k = (i, layout)
        if k not in cache:
            cache[k] = local_input(slots[i], layout, mesh_shape, coord, (seed, "arg", i, layout))
        return cache[k].clone()

    report = RuleReport(op, mesh_shape, names, total, len(combos), notes=notes)
    for start in range(0, len(combos), _BATCH):
        batch = combos[start:start + _BATCH]
        results = [_run_combo_safely(op, sample_args, sample_kwargs, c, mesh, local_of) for c in batch]
        # The one collective: the same count on every rank, whatever happened locally.
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (coord, [payload for _, payload in results]), group=group)
        for j, (combo, (info, _)) in enumerate(zip(batch, results)):
            per_rank = {c: payloads[j] for c, payloads in gathered}
            _classify(report, combo, info, per_rank, refs, mesh_shape, atol, rtol, in_place)
    return report


def _plan_combos(slots, names, mesh_ndim, max_per_arg, max_combos, seed):
    """(total, combinations to check, notes): every layout of every argument, capped deterministically."""
    rng = random.Random(seed)  # seeded by an int: the same sequence on every rank and run
    notes, layouts = [], []
    for i, t in enumerate(slots):
        every = list(itertools.product(placement_options(t), repeat=mesh_ndim))
        keep = _select(len(every), max_per_arg, rng)
        if len(keep) < len(every):
            notes.append(f"note: argument {names[i]}: {len(keep)} of {len(every)} layouts tried "
                         f"(max_per_arg={max_per_arg}, seed={seed})")
        layouts.append([every[j] for j in keep])
    total, combos = _enumerate(layouts, max_combos, rng)
    if len(combos) < total:
        notes.append(f"note: {len(combos)} of {total} input combinations checked (max_combos={max_combos}, "
                     f"seed={seed}, a deterministic sample)")
    return total, combos, notes


def _first_ranks_sample(args, kwargs, mesh, src: int, group):
    """(args, kwargs) of rank ``src`` (the mesh's first rank) on every rank: one broadcast.

    Tensors travel as raw bytes with their shape and strides (dense layouts are kept),
    other arguments as they are.
    """
    payload = [None]
    if dist.get_rank() == src:
        payload[0] = _pack_sample((tuple(args), dict(kwargs)))
    dist.broadcast_object_list(payload, src=src, group=group)
    if dist.get_rank() == src:
        return tuple(args), dict(kwargs)
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    return _unpack_sample(payload[0], device)


class _PackedTensor(tuple):
    """(dtype, shape, stride, raw bytes) of a sample tensor, as broadcast."""


def _pack_sample(obj):
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return _PackedTensor((t.dtype, tuple(t.shape), tuple(t.stride()), _pack(t)[2]))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_pack_sample(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _pack_sample(v) for k, v in obj.items()}
    return obj


def _unpack_sample(obj, device):
    if type(obj) is _PackedTensor:
        dtype, shape, stride, raw = obj
        value = _unpack((dtype, shape, raw)).to(device)
        try:  # the sender's strides (a transposed sample stays transposed) where they are dense
            return torch.empty_strided(shape, stride, dtype=dtype, device=device).copy_(value)
        except RuntimeError:  # overlapping strides (an expanded tensor): a contiguous copy
            return value.clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unpack_sample(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _unpack_sample(v, device) for k, v in obj.items()}
    return obj


def _classify(report, combo, info, per_rank, refs, mesh_shape, atol, rtol, in_place) -> None:
    """Put one combination in its list; the same on every rank (it reads only gathered data)."""
    kind, sharding, placements = info
    if kind == "crashed":
        report.errors.append(Finding(combo, message=f"rule raised {sharding}"))
        return
    failed = [(c, p[1]) for c, p in sorted(per_rank.items()) if p[0] != "ok"]
    counts = sorted({len(p[1]) for p in per_rank.values() if p[0] == "ok"})
    if failed or counts != [len(refs)]:
        if kind == "accepted":
            msg = (f"op on coordinate {failed[0][0]}: {failed[0][1]}" if failed else
                   f"{' or '.join(map(str, counts))} outputs on the shards, {len(refs)} on the full sample")
            report.errors.append(Finding(combo, message=msg))
        else:  # the op cannot run on these shards as they are: moving them is the only way
            _not_missing(report, combo, kind, sharding)
        return
    pieces = [{c: _unpack(p[1][o]) for c, p in per_rank.items()} for o in range(len(refs))]

    def correct(o, only=None, first_only=False):
        if not isinstance(refs[o], torch.Tensor):
            return ((),)  # a non-tensor output: nothing to place
        return correct_layouts(pieces[o], refs[o], mesh_shape, atol, rtol, only, first_only)

    if kind == "accepted":
        outs = tuple(placements)
        wrong = [o for o, pl in enumerate(outs) if pl is not None and not correct(o, pl)]
        if wrong:
            alts = tuple(() if outs[o] is None else correct(o) for o in range(len(refs)))
            report.incorrect.append(Finding(combo, outs, alts, message=f"output {wrong[0]} is wrong as "
                                            f"{_fmt_layout(outs[wrong[0]])}"))
        else:
            report.accepted.append(Finding(combo, outs))
        return
    # The rule moves (or refuses) the inputs: would the shards as they are have given a right answer?
    # In place, the result must keep the target's layout.
    if kind == "rejected":
        saves = True
    else:  # only a redistribution that communicates is worth avoiding (R -> S or R -> P is a local step)
        saves = any(any(mesh_shape[m] > 1 for step in p.collectives for m in step.mesh_dims)
                    for p in sharding.plans if p is not None)
    target = [combo[0] if in_place and o == 0 else None for o in range(len(refs))]
    if not (saves and all(correct(o, target[o], first_only=True) for o in range(len(refs)))):
        _not_missing(report, combo, kind, sharding)
        return
    alts = tuple(correct(o, target[o]) for o in range(len(refs)))
    outs = tuple(a[0] if a[0] else None for a in alts)
    if kind == "rejected":
        report.missing.append(Finding(combo, outs, alts, cost=math.inf, message=f"rule rejects: {sharding}"))
    else:
        rule_in = tuple(s.placements for s in sharding.in_specs)
        cost = sum(p.cost for p in sharding.plans if p is not None)
        report.missing.append(Finding(combo, outs, alts, rule_in, cost))


def _not_missing(report, combo, kind, sharding) -> None:
    if kind == "rejected":
        report.rejected.append(Finding(combo, message=str(sharding)))
    else:
        report.redistributed += 1


def _leaves(obj) -> list:
    out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            out.extend(_leaves(v))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out.extend(_leaves(v))
    return out


def _slot_names(args, kwargs) -> Tuple[str, ...]:
    """Names of the DTensor arguments, e.g. ``args[0] (8, 6)``, ``args[1][2] (4,)``, ``weight (6,)``."""
    names = []

    def walk(obj, name):
        if isinstance(obj, torch.Tensor):
            if _is_slot(obj):
                names.append(f"{name} {tuple(obj.shape)}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{name}[{i}]")

    for i, a in enumerate(args):
        walk(a, f"args[{i}]")
    for k, v in kwargs.items():
        walk(v, k)
    return tuple(names)
