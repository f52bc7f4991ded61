"""Matmul and reduction rules (ops/matmul.py, ops/reduction.py) on 4 ranks: a 1-d mesh and 2x2.

Three kinds of checks, each batched into few ``run_on_ranks`` calls:

* ``check_sharding_rule`` on every input layout of a sample call (R, S(d), and every
  Partial on each mesh dim): no option the rules take may give a wrong result, and
  the options we rely on (mm S(1) x S(0) -> P(sum), sum over a shard -> P(sum), ...)
  must be taken without communication;
* end to end through the public API (torch.mm, x.sum(...), in-place, out=), on
  uneven shapes, comparing ``full_tensor()`` with plain torch on the full tensors;
* the placements the engine picks for the main cases.
"""

import itertools
import traceback

import pytest
import torch

from shardprop import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from shardprop.layout import chunk_bounds
from tests.rankpool import run_on_ranks

aten = torch.ops.aten
MESHES = {"1d": (4,), "2d": (2, 2)}
R, P, PA, PM, PN = Replicate(), Partial("sum"), Partial("avg"), Partial("max"), Partial("min")
S0, S1, S2 = Shard(0), Shard(1), Shard(2)


def _op(name):
    """aten overload from 'mm.default' (ops are not picklable: cases carry names)."""
    packet, overload = name.split(".")
    return getattr(getattr(aten, packet), overload)


def _sample(spec, gen):
    """A tuple is the shape of a float64 tensor; ('bool', shape) a boolean one; anything else as is."""
    if isinstance(spec, tuple) and spec and spec[0] == "bool":
        return torch.rand(spec[1], generator=gen, dtype=torch.float64) > 0.8
    if isinstance(spec, tuple) and all(isinstance(s, int) for s in spec):
        return torch.randn(spec, generator=gen, dtype=torch.float64)
    return spec


# ------------------------------------------------------------------ check_sharding_rule
# (op, sample args, sample kwargs). Shapes are uneven on 4 ranks unless noted.
RULE_CASES = [
    ("mm.default", [(5, 7), (7, 3)], {}),
    ("mm.default", [(8, 4), (4, 8)], {}),  # even
    ("addmm.default", [(3,), (5, 7), (7, 3)], {"beta": 0.5, "alpha": 2.0}),
    ("addmm.default", [(5, 3), (5, 7), (7, 3)], {}),
    ("addmm.default", [(5, 1), (5, 7), (7, 3)], {}),
    ("bmm.default", [(3, 5, 6), (3, 6, 2)], {}),
    ("baddbmm.default", [(3, 5, 2), (3, 5, 6), (3, 6, 2)], {"alpha": -1.5}),
    ("baddbmm.default", [(5, 2), (3, 5, 6), (3, 6, 2)], {}),
    ("addbmm.default", [(5, 2), (3, 5, 6), (3, 6, 2)], {}),
    ("dot.default", [(7,), (7,)], {}),
    ("mv.default", [(5, 7), (7,)], {}),
    ("addmv.default", [(5,), (5, 7), (7,)], {}),
    ("addr.default", [(5, 3), (5,), (3,)], {}),
    ("sum.default", [(5, 7)], {}),
    ("sum.dim_IntList", [(5, 7), [0]], {}),
    ("sum.dim_IntList", [(5, 7), [-1], True], {}),
    ("sum.dim_IntList", [(3, 5, 7), [0, 2]], {}),
    ("sum.dim_IntList", [(5, 7), []], {}),
    ("nansum.default", [(5, 7), [1]], {}),
    ("mean.default", [(8, 4)], {}),
    ("mean.dim", [(8, 7), [0]], {}),  # even reduced dim
    ("mean.dim", [(5, 8), [0]], {}),  # uneven reduced dim
    ("mean.dim", [(5, 8), [-1], True], {}),
    ("mean.dim", [(4, 6, 8), [0, 2]], {}),
    ("amax.default", [(8, 7), [0]], {}),
    ("amax.default", [(5, 7), [0]], {}),  # one chunk of dim 0 is empty on 4 ranks
    ("amin.default", [(5, 8), [1], True], {}),
    ("max.default", [(8, 4)], {}),
    ("min.default", [(8, 4)], {}),
    ("max.dim", [(5, 7), 1], {}),
    ("min.dim", [(5, 7), 0, True], {}),
    ("argmax.default", [(5, 7), 1], {}),
    ("argmin.default", [(5, 7)], {}),
    ("prod.dim_int", [(5, 7), 0], {}),
    ("var.correction", [(5, 7), [1]], {}),
    ("std.correction", [(5, 7), [0]], {"keepdim": True}),
    ("var_mean.correction", [(5, 7), [1]], {}),
    ("logsumexp.default", [(5, 7), [0]], {}),
    ("linalg_vector_norm.default", [(5, 7), 2, [1]], {}),
    ("aminmax.default", [(8, 7)], {"dim": 0}),
    ("count_nonzero.dim_IntList", [("bool", (5, 7)), [0]], {}),
    ("any.dim", [("bool", (5, 7)), 0], {}),
    ("all.dims", [("bool", (5, 7)), [1]], {}),
    ("any.default", [("bool", (5, 7))], {}),
]


def _check_rules(mesh_shape, cases):
    """Rank side: a report per case (summary text, incorrect/error findings, accepted layouts)."""
    from shardprop.check import check_sharding_rule

    mesh = init_device_mesh("cpu", mesh_shape)
    out = []
    for name, args, kwargs in cases:
        gen = torch.Generator().manual_seed(0)
        args = [_sample(a, gen) for a in args]
        # Boolean samples must stay boolean; floats are perturbed by the checker.
        r = check_sharding_rule(_op(name), *args, mesh=mesh, perturb=True, **kwargs)
        out.append({
            "summary": r.summary(),
            "bad": [str(f) + ": " + f.message for f in r.incorrect + r.errors],
            "accepted": {f.inputs: f.outputs for f in r.accepted},
            "missing": [str(f) for f in r.missing],
        })
    return out


@pytest.fixture(scope="module", params=list(MESHES))
def rule_reports(request):
    mesh_shape = MESHES[request.param]
    reports = run_on_ranks(4, _check_rules, mesh_shape, RULE_CASES, timeout=600)[0]
    return mesh_shape, dict(zip(((n, repr(a), repr(k)) for n, a, k in RULE_CASES), reports))


def _report(rule_reports, i):
    mesh_shape, reports = rule_reports
    name, args, kwargs = RULE_CASES[i]
    return mesh_shape, reports[(name, repr(args), repr(kwargs))]


@pytest.mark.parametrize("i", range(len(RULE_CASES)), ids=[f"{n}{a}" for n, a, _ in RULE_CASES])
def test_rule_never_wrong(rule_reports, i):
    mesh_shape, rep = _report(rule_reports, i)
    assert not rep["bad"], f"{rep['summary']}\n" + "\n".join(rep["bad"][:20])
    assert rep["accepted"], f"no layout ran without redistribution: {rep['summary']}"


def _accepted(rule_reports, name, args, kwargs=None):
    """inputs -> outputs of the layouts the rule took as they were, for one case."""
    mesh_shape, reports = rule_reports
    return mesh_shape, reports[(name, repr(args), repr(kwargs or {}))]["accepted"]


# The main cases: (case, inputs (one placement per argument, used on every mesh dim), expected output).
EXPECTED = [
    (("mm.default", [(5, 7), (7, 3)]), (S0, R), S0),
    (("mm.default", [(5, 7), (7, 3)]), (R, S1), S1),
    (("mm.default", [(5, 7), (7, 3)]), (S1, S0), P),
    (("mm.default", [(5, 7), (7, 3)]), (P, R), P),
    (("mm.default", [(5, 7), (7, 3)]), (R, P), P),
    (("mm.default", [(5, 7), (7, 3)]), (R, PA), PA),
    (("mm.default", [(5, 7), (7, 3)]), (R, R), R),
    (("addmm.default", [(3,), (5, 7), (7, 3)], {"beta": 0.5, "alpha": 2.0}), (R, S0, R), S0),
    (("addmm.default", [(3,), (5, 7), (7, 3)], {"beta": 0.5, "alpha": 2.0}), (S0, R, S1), S1),
    (("addmm.default", [(3,), (5, 7), (7, 3)], {"beta": 0.5, "alpha": 2.0}), (P, S1, S0), P),
    (("addmm.default", [(3,), (5, 7), (7, 3)], {"beta": 0.5, "alpha": 2.0}), (P, P, R), P),
    (("addmm.default", [(5, 3), (5, 7), (7, 3)]), (S0, S0, R), S0),
    (("addmm.default", [(5, 1), (5, 7), (7, 3)]), (R, R, S1), S1),
    (("bmm.default", [(3, 5, 6), (3, 6, 2)]), (S0, S0), S0),
    (("bmm.default", [(3, 5, 6), (3, 6, 2)]), (S2, S1), P),
    (("bmm.default", [(3, 5, 6), (3, 6, 2)]), (S1, R), S1),
    (("baddbmm.default", [(5, 2), (3, 5, 6), (3, 6, 2)]), (R, S0, S0), S0),
    (("baddbmm.default", [(5, 2), (3, 5, 6), (3, 6, 2)]), (S0, S1, R), S1),
    (("addbmm.default", [(5, 2), (3, 5, 6), (3, 6, 2)]), (P, S0, S0), P),
    (("dot.default", [(7,), (7,)]), (S0, S0), P),
    (("mv.default", [(5, 7), (7,)]), (S1, S0), P),
    (("mv.default", [(5, 7), (7,)]), (S0, R), S0),
    (("addr.default", [(5, 3), (5,), (3,)]), (S1, R, S0), S1),
    (("sum.default", [(5, 7)]), (S1,), P),
    (("sum.dim_IntList", [(5, 7), [0]]), (S0,), P),
    (("sum.dim_IntList", [(5, 7), [0]]), (S1,), S0),
    (("sum.dim_IntList", [(5, 7), [0]]), (PA,), PA),
    (("sum.dim_IntList", [(5, 7), [-1], True]), (S0,), S0),
    (("sum.dim_IntList", [(5, 7), [-1], True]), (S1,), P),
    (("sum.dim_IntList", [(3, 5, 7), [0, 2]]), (S1,), S0),
    (("sum.dim_IntList", [(5, 7), []]), (S0,), P),
    (("mean.dim", [(8, 7), [0]]), (S0,), PA),
    (("mean.dim", [(8, 7), [0]]), (P,), P),
    (("mean.dim", [(5, 8), [-1], True]), (S0,), S0),
    (("mean.dim", [(4, 6, 8), [0, 2]]), (S2,), PA),
    (("mean.dim", [(4, 6, 8), [0, 2]]), (S1,), S0),
    (("amax.default", [(8, 7), [0]]), (S0,), PM),
    (("amax.default", [(8, 7), [0]]), (PM,), PM),
    (("amin.default", [(5, 8), [1], True]), (S1,), PN),
    (("max.default", [(8, 4)]), (S1,), PM),
    (("min.default", [(8, 4)]), (S0,), PN),
    (("max.dim", [(5, 7), 1]), (S0,), (S0, S0)),
    (("min.dim", [(5, 7), 0, True]), (S1,), (S1, S1)),
    (("argmax.default", [(5, 7), 1]), (S0,), S0),
    (("prod.dim_int", [(5, 7), 0]), (S1,), S0),
    (("var.correction", [(5, 7), [1]]), (S0,), S0),
    (("aminmax.default", [(8, 7)], {"dim": 0}), (S0,), (PN, PM)),
    (("aminmax.default", [(8, 7)], {"dim": 0}), (S1,), (S0, S0)),
    (("logsumexp.default", [(5, 7), [0]]), (S1,), S0),
]


@pytest.mark.parametrize("case,inputs,out", EXPECTED, ids=[f"{c[0]}{c[1]}-{i}" for c, i, _ in EXPECTED])
def test_expected_option_taken(rule_reports, case, inputs, out):
    """The main options run with no communication and give the placement we expect."""
    name, args = case[0], case[1]
    mesh_shape, accepted = _accepted(rule_reports, name, args, case[2] if len(case) > 2 else None)
    key = tuple((p,) * len(mesh_shape) for p in inputs)
    outs = out if isinstance(out, tuple) else (out,)
    want = tuple((p,) * len(mesh_shape) for p in outs)
    assert key in accepted, f"{name} {args}: {list(inputs)} was redistributed, expected it to give {out}"
    assert accepted[key] == want, f"{name} {args}: {list(inputs)} gave {accepted[key]}, expected {want}"


# Layouts that must NOT be taken as they are (they would need the unsound shortcuts).
NOT_ACCEPTED = [
    (("mean.dim", [(5, 8), [0]]), (S0,)),       # uneven: local means of unequal chunks
    (("amax.default", [(5, 7), [0]]), (S0,)),   # an empty chunk: max over nothing
    (("amax.default", [(8, 7), [0]]), (P,)),    # max does not commute with sum
    (("argmax.default", [(5, 7), 1]), (S1,)),   # local indices
    (("max.dim", [(5, 7), 1]), (S1,)),
    (("prod.dim_int", [(5, 7), 0]), (S0,)),
    (("var.correction", [(5, 7), [1]]), (S1,)),
    (("var.correction", [(5, 7), [1]]), (P,)),
    (("mm.default", [(5, 7), (7, 3)]), (P, P)),
    (("mm.default", [(5, 7), (7, 3)]), (S1, R)),
    (("addmm.default", [(3,), (5, 7), (7, 3)], {"beta": 0.5, "alpha": 2.0}), (R, S1, S0)),
    (("addmm.default", [(3,), (5, 7), (7, 3)], {"beta": 0.5, "alpha": 2.0}), (R, P, R)),
]


@pytest.mark.parametrize("case,inputs", NOT_ACCEPTED, ids=[f"{c[0]}-{i}" for c, i in NOT_ACCEPTED])
def test_unsound_option_not_taken(rule_reports, case, inputs):
    name, args = case[0], case[1]
    mesh_shape, accepted = _accepted(rule_reports, name, args, case[2] if len(case) > 2 else None)
    key = tuple((p,) * len(mesh_shape) for p in inputs)
    assert key not in accepted, f"{name} {args}: {list(inputs)} ran as is, giving {accepted.get(key)}"


# ------------------------------------------------------------------ end to end through dispatch
def _parts(value, reduce_op, k, gen):
    """``k`` different tensors whose ``reduce_op`` reduction is ``value``."""
    noise = [torch.randn(value.shape, generator=gen, dtype=value.dtype) for _ in range(k)]
    if reduce_op == "sum":
        return [value / k + n - sum(noise) / k for n in noise]
    if reduce_op == "avg":
        return [value + n - sum(noise) / k for n in noise]
    owner = torch.randint(k, value.shape, generator=gen)
    sign = -1.0 if reduce_op == "max" else 1.0
    return [torch.where(owner == i, value, value + sign * (n.abs() + 0.1)) for i, n in enumerate(noise)]


def _local_piece(full, layout, mesh_shape, coord, seed):
    """This coordinate's piece of ``full`` under ``layout``, cut and split independently of shardprop."""
    value = full
    for m, p in enumerate(layout):
        if type(p) is Shard:
            pieces = torch.chunk(value, mesh_shape[m], dim=p.dim) if value.shape[p.dim] else ()
            value = pieces[coord[m]] if coord[m] < len(pieces) else value.narrow(p.dim, value.shape[p.dim], 0)
        elif type(p) is Partial:
            # Ranks that share coord[:m] hold the same value here: seed by it so they split it alike.
            gen = torch.Generator().manual_seed(seed * 1000 + hash(tuple(coord[:m])) % 997 + m)
            value = _parts(value, p.reduce_op, mesh_shape[m], gen)[coord[m]]
    return value.contiguous().clone()


def _e2e(mesh_shape, cases):
    """Rank side: run each (op name, args, kwargs, layouts) through dispatch; None or an error per case.

    Stops at the first exception: ranks may be out of step after one.
    """
    mesh = init_device_mesh("cpu", mesh_shape)
    coord = tuple(mesh.get_coordinate())
    results = []
    for n, (name, args, kwargs, layouts) in enumerate(cases):
        try:
            gen = torch.Generator().manual_seed(n)
            full_args = [_sample(a, gen) for a in args]
            it = iter(layouts)
            dt_args = []
            for a in full_args:
                if isinstance(a, torch.Tensor) and a.ndim:
                    layout = next(it)
                    local = _local_piece(a, layout, mesh_shape, coord, n)
                    a = DTensor.from_local(local, mesh, layout, shape=a.shape, stride=a.stride())
                dt_args.append(a)
            op = _op(name)
            want = op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in full_args], **kwargs)
            got = op(*dt_args, **kwargs)
            want = want if isinstance(want, tuple) else (want,)
            got = got if isinstance(got, tuple) else (got,)
            problems = []
            for w, g in zip(want, got):
                if not isinstance(g, DTensor):
                    problems.append(f"output is {type(g).__name__}")
                    continue
                full = g.full_tensor()
                if full.shape != w.shape or full.dtype != w.dtype or not torch.allclose(
                        full.double(), w.double(), rtol=1e-6, atol=1e-8, equal_nan=True):
                    problems.append(f"got {list(g.placements)} {full} expected {w}")
            results.append((tuple(tuple(g.placements) for g in got if isinstance(g, DTensor)), problems))
        except Exception:
            results.append((None, ["raised:\n" + traceback.format_exc()]))
            break
    return results
