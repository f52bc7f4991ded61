"""Matmul and reduction rules (ops/matmul.py, ops/reduction.py) on 4 ranks: a 1-d mesh and 2x2.

Each kind of check is batched into one ``run_on_ranks`` call per mesh:

* ``check_sharding_rule`` on the input layouts of sample calls (R, S(d), every Partial
  on each mesh dim): no layout a rule takes as is may give a wrong result;
* end to end through dispatch on uneven shapes (5x7 on 4 ranks leaves a rank with an
  empty chunk), comparing ``full_tensor()`` with plain torch on the full tensors, for
  every Replicate/Shard combination (and Partial ones on the 1-d mesh);
* for the main cases, the placement the engine picks and that it moved nothing
  (mm S(1) x S(0) -> P(sum), sum over a shard -> P(sum), mean over an even shard ->
  P(avg), ...), and that unsound shortcuts are not taken (mean over an uneven shard,
  max of a P(sum), argmax over a shard, ...);
* in-place (addmm_), out= and backward.
"""

import itertools
import random
import traceback
import zlib

import pytest
import torch

from shardprop import DTensor, Partial, Replicate, Shard, ShardingError, init_device_mesh
from tests.rankpool import run_on_ranks

aten = torch.ops.aten
MESHES = {"1d": (4,), "2d": (2, 2)}
R, P, PA, PM, PN = Replicate(), Partial("sum"), Partial("avg"), Partial("max"), Partial("min")
PP = Partial("product")
S0, S1, S2 = Shard(0), Shard(1), Shard(2)


def _op(name):
    """The aten overload for 'mm.default' (ops are not picklable: cases carry names)."""
    packet, overload = name.split(".")
    return getattr(getattr(aten, packet), overload)


def _sample(spec, gen):
    """A shape tuple -> a float64 tensor; ('bool', shape) -> a boolean one; anything else as is."""
    shape = _shape(spec)
    if shape is None:
        return spec
    if spec[0] == "bool":
        return torch.rand(shape, generator=gen, dtype=torch.float64) > 0.7
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _shape(spec):
    """The shape a sample-argument spec describes, or None if it is not a tensor."""
    if isinstance(spec, tuple) and spec and spec[0] == "bool":
        return spec[1]
    if isinstance(spec, tuple) and all(isinstance(s, int) for s in spec):
        return spec
    return None


# ------------------------------------------------------------------ sample calls
# name -> (op, sample args, sample kwargs). Shapes are uneven on 4 ranks unless noted.
CASES = {
    "mm": ("mm.default", [(5, 7), (7, 3)], {}),
    "mm_even": ("mm.default", [(8, 4), (4, 8)], {}),
    "addmm_bias1d": ("addmm.default", [(3,), (5, 7), (7, 3)], {"beta": 0.5, "alpha": 2.0}),
    "addmm_bias2d": ("addmm.default", [(5, 3), (5, 7), (7, 3)], {}),
    "addmm_bias_col": ("addmm.default", [(5, 1), (5, 7), (7, 3)], {}),
    "addmm_beta_neg": ("addmm.default", [(5, 3), (5, 7), (7, 3)], {"beta": -1}),
    "bmm": ("bmm.default", [(3, 5, 6), (3, 6, 2)], {}),
    "baddbmm": ("baddbmm.default", [(3, 5, 2), (3, 5, 6), (3, 6, 2)], {"alpha": -1.5}),
    "baddbmm_bias2d": ("baddbmm.default", [(5, 2), (3, 5, 6), (3, 6, 2)], {}),
    "addbmm": ("addbmm.default", [(5, 2), (3, 5, 6), (3, 6, 2)], {}),
    "dot": ("dot.default", [(7,), (7,)], {}),
    "mv": ("mv.default", [(5, 7), (7,)], {}),
    "addmv": ("addmv.default", [(5,), (5, 7), (7,)], {}),
    "addr": ("addr.default", [(5, 3), (5,), (3,)], {}),
    "sum": ("sum.default", [(5, 7)], {}),
    "sum_d0": ("sum.dim_IntList", [(5, 7), [0]], {}),
    "sum_last_keep": ("sum.dim_IntList", [(5, 7), [-1], True], {}),
    "sum_d02": ("sum.dim_IntList", [(3, 5, 7), [0, 2]], {}),
    "sum_empty_dims": ("sum.dim_IntList", [(5, 7), []], {}),
    "nansum_d1": ("nansum.default", [(5, 7), [1]], {}),
    "mean": ("mean.default", [(8, 4)], {}),
    "mean_even": ("mean.dim", [(8, 7), [0]], {}),
    "mean_uneven": ("mean.dim", [(5, 8), [0]], {}),
    "mean_2d_uneven": ("mean.dim", [(6, 8), [0]], {}),  # 6 splits evenly in 2, not in 2 then 2
    "mean_last_keep": ("mean.dim", [(5, 8), [-1], True], {}),
    "mean_d02": ("mean.dim", [(4, 6, 8), [0, 2]], {}),
    "amax_even": ("amax.default", [(8, 7), [0]], {}),
    "amax_empty_chunk": ("amax.default", [(3, 7), [0]], {}),  # 3 on 4 ranks: a rank holds nothing
    "amin_keep": ("amin.default", [(5, 8), [1], True], {}),
    "max": ("max.default", [(8, 4)], {}),
    "min": ("min.default", [(8, 4)], {}),
    "max_dim": ("max.dim", [(5, 7), 1], {}),
    "min_dim_keep": ("min.dim", [(5, 7), 0, True], {}),
    "argmax_d1": ("argmax.default", [(5, 7), 1], {}),
    "argmin_all": ("argmin.default", [(5, 7)], {}),
    "prod_d0": ("prod.dim_int", [(5, 7), 0], {}),
    "var_d1": ("var.correction", [(5, 7), [1]], {}),
    "std_d0_keep": ("std.correction", [(5, 7), [0]], {"keepdim": True}),
    "var_mean_d1": ("var_mean.correction", [(5, 7), [1]], {}),
    "logsumexp_d0": ("logsumexp.default", [(5, 7), [0]], {}),
    "norm_d1": ("linalg_vector_norm.default", [(5, 7), 2, [1]], {}),
    "aminmax_d0": ("aminmax.default", [(8, 7)], {"dim": 0}),
    "count_nonzero_d0": ("count_nonzero.dim_IntList", [("bool", (5, 7)), [0]], {}),
    "any_d0": ("any.dim", [("bool", (5, 7)), 0], {}),
    "all_d1": ("all.dims", [("bool", (5, 7)), [1]], {}),
    "any": ("any.default", [("bool", (5, 7))], {}),
}
# On the 2x2 mesh the checker samples: these cover each family.
CASES_2D = ["mm", "addmm_bias1d", "bmm", "dot", "sum_d0", "sum_d02", "mean_even", "mean_2d_uneven",
            "amax_empty_chunk", "max_dim", "argmax_d1", "var_d1", "aminmax_d0", "any_d0"]


# ------------------------------------------------------------------ check_sharding_rule
def _check_rules(mesh_shape, names, max_combos):
    """Rank side: per case, the checker's summary and every incorrect / error finding."""
    from shardprop.debug.check_rule import check_sharding_rule

    mesh = init_device_mesh("cpu", mesh_shape)
    out = {}
    for name in names:
        opname, args, kwargs = CASES[name]
        gen = torch.Generator().manual_seed(0)
        args = [_sample(a, gen) for a in args]
        r = check_sharding_rule(_op(opname), *args, mesh=mesh, max_combos=max_combos, **kwargs)
        out[name] = (r.summary(), [f"{f}: {f.message}" for f in r.incorrect + r.errors], len(r.accepted))
    return out


MAX_COMBOS = 80  # per case: matmuls with 3 DTensor inputs have hundreds of layout combinations


@pytest.fixture(scope="module")
def rule_reports_1d():
    return run_on_ranks(4, _check_rules, MESHES["1d"], list(CASES), MAX_COMBOS, timeout=600)[0]


@pytest.fixture(scope="module")
def rule_reports_2d():
    return run_on_ranks(4, _check_rules, MESHES["2d"], CASES_2D, MAX_COMBOS, timeout=600)[0]


@pytest.mark.parametrize("mesh,name", [("1d", n) for n in CASES] + [("2d", n) for n in CASES_2D])
def test_rule_never_wrong(request, mesh, name):
    summary, bad, n_accepted = request.getfixturevalue(f"rule_reports_{mesh}")[name]
    assert not bad, f"{summary}\n" + "\n".join(bad[:20])
    assert n_accepted, f"no layout ran without redistribution: {summary}"


# ------------------------------------------------------------------ end to end through dispatch
def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def _parts(value, reduce_op, k, gen):
    """``k`` different tensors whose ``reduce_op`` reduction is ``value``."""
    noise = [torch.randn(value.shape, generator=gen, dtype=torch.float64) for _ in range(k)]
    if reduce_op == "sum":
        return [value / k + n - sum(noise) / k for n in noise]
    if reduce_op == "avg":
        return [value + n - sum(noise) / k for n in noise]
    owner = torch.randint(k, value.shape, generator=gen)
    sign = -1.0 if reduce_op == "max" else 1.0
    return [torch.where(owner == i, value, value + sign * (n.abs() + 0.1)) for i, n in enumerate(noise)]


def _local_piece(full, layout, mesh_shape, coord, key):
    """This coordinate's piece of ``full`` under ``layout``, cut with torch.chunk, independently of shardprop."""
    value = full
    for m, p in enumerate(layout):
        if type(p) is Shard:
            pieces = torch.chunk(value, mesh_shape[m], dim=p.dim) if value.shape[p.dim] else ()
            value = pieces[coord[m]] if coord[m] < len(pieces) else value.narrow(p.dim, value.shape[p.dim], 0)
        elif type(p) is Partial:
            # Ranks sharing coord[:m] hold the same value here: seeding by it makes them split it alike.
            gen = torch.Generator().manual_seed(_seed(key, m, tuple(coord[:m])))
            value = _parts(value.double(), p.reduce_op, mesh_shape[m], gen)[coord[m]].to(full.dtype)
    return value.contiguous().clone()


def _close(got, want):
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.is_floating_point():
        return torch.allclose(got, want, rtol=1e-6, atol=1e-9, equal_nan=True)
    return torch.equal(got, want)


def _run_one(mesh, key, opname, args, kwargs, layouts, inplace_or_out=None):
    """Run one call on DTensors built from ``layouts``; (output placements, moved?, problems)."""
    from shardprop.debug.explain import explain

    mesh_shape, coord = tuple(mesh.shape), tuple(mesh.get_coordinate())
    gen = torch.Generator().manual_seed(_seed(key))
    full_args = [_sample(a, gen) for a in args]
    layouts = iter(layouts)
    dt_args = []
    for i, a in enumerate(full_args):
        if isinstance(a, torch.Tensor) and a.ndim:
            layout = next(layouts)
            local = _local_piece(a, layout, mesh_shape, coord, (key, i))
            a = DTensor.from_local(local, mesh, layout, shape=a.shape, stride=a.stride())
        dt_args.append(a)
    op = _op(opname)
    want = op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in full_args], **kwargs)
    dt_kwargs = dict(kwargs)
    if inplace_or_out is not None:  # ("out", placements, out= overload): an out= DTensor laid out as given
        op = _op(inplace_or_out[2])
        out_full = torch.zeros_like(want)
        dt_kwargs["out"] = DTensor.from_local(_local_piece(out_full, inplace_or_out[1], mesh_shape, coord, key),
                                              mesh, inplace_or_out[1], shape=want.shape, stride=want.stride())
    with explain() as ex:
        got = op(*dt_args, **dt_kwargs)
    moved = any(r.redistributions for r in ex.records)
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    problems = []
    if inplace_or_out is not None and got[0] is not dt_kwargs["out"]:
        problems.append("out= call did not return its out tensor")
    if opname.split(".")[0].endswith("_") and got[0] is not dt_args[0]:
        problems.append("in-place call did not return its target")
    for w, g in zip(want, got):
        if not isinstance(g, DTensor):
            problems.append(f"an output is a {type(g).__name__}")
            continue
        full = g.full_tensor()
        if not _close(full, w):
            problems.append(f"wrong result as {list(g.placements)}: {full} expected {w}")
    return tuple(tuple(g.placements) for g in got if isinstance(g, DTensor)), moved, problems


def _e2e(mesh_shape, calls):
    """Rank side: {call key: (output placements, moved, problems)}; stops at the first exception.

    A call is (key, op name, args, kwargs, layouts[, ("out", placements, out= overload)]), layouts one
    per-mesh-dim placement tuple per DTensor argument.
    """
    mesh = init_device_mesh("cpu", mesh_shape)
    results = {}
    for key, opname, args, kwargs, layouts, *extra in calls:
        try:
            results[key] = _run_one(mesh, key, opname, args, kwargs, layouts, *extra)
        except ShardingError as e:  # raised by propagation on every rank alike: ranks stay in step
            results[key] = (None, None, [f"ShardingError: {e}"])
        except Exception:
            results[key] = (None, None, ["raised:\n" + traceback.format_exc()])
            break
    return results


def _layout(p, mesh_ndim):
    return p if isinstance(p, tuple) else (p,) * mesh_ndim


# The main cases: (case, inputs, expected outputs). A single placement means "on every mesh dim".
EXPECTED = [
    ("mm", (S0, R), S0),
    ("mm", (R, S1), S1),
    ("mm", (S1, S0), P),
    ("mm", (P, R), P),
    ("mm", (R, P), P),
    ("mm", (R, PA), PA),
    ("mm", (R, R), R),
    ("mm_even", (S1, S0), P),
    ("addmm_bias1d", (R, S0, R), S0),
    ("addmm_bias1d", (S0, R, S1), S1),
    ("addmm_bias1d", (P, S1, S0), P),
    ("addmm_bias1d", (P, P, R), P),
    ("addmm_bias2d", (S0, S0, R), S0),
    ("addmm_bias2d", (PM, R, R), PM),  # int beta=1: a replicated product added to a P(max) bias
    ("addmm_bias_col", (R, R, S1), S1),
    ("bmm", (S0, S0), S0),
    ("bmm", (S2, S1), P),
    ("bmm", (S1, R), S1),
    ("baddbmm_bias2d", (R, S0, S0), S0),
    ("baddbmm_bias2d", (S0, S1, R), S1),
    ("addbmm", (P, S0, S0), P),
    ("dot", (S0, S0), P),
    ("mv", (S1, S0), P),
    ("mv", (S0, R), S0),
    ("addr", (S1, R, S0), S1),
    ("sum", (S1,), P),
    ("sum_d0", (S0,), P),
    ("sum_d0", (S1,), S0),
    ("sum_d0", (PA,), PA),
    ("sum_last_keep", (S0,), S0),
    ("sum_last_keep", (S1,), P),
    ("sum_d02", (S1,), S0),
    ("sum_d02", (S2,), P),
    ("sum_empty_dims", (S0,), P),
    ("nansum_d1", (S1,), P),
    ("mean", (S0,), PA),
    ("mean_even", (S0,), PA),
    ("mean_even", (P,), P),
    ("mean_last_keep", (S0,), S0),
    ("mean_d02", (S2,), PA),
    ("mean_d02", (S1,), S0),
    ("amax_even", (S0,), PM),
    ("amax_even", (PM,), PM),
    ("amin_keep", (S1,), PN),
    ("max", (S1,), PM),
    ("min", (S0,), PN),
    ("max_dim", (S0,), (S0, S0)),
    ("min_dim_keep", (S1,), (S1, S1)),
    ("argmax_d1", (S0,), S0),
    ("prod_d0", (S1,), S0),
    ("prod_d0", (S0,), PP),  # local products multiply (the empty chunk's product is 1)
    ("var_d1", (S0,), S0),
    ("var_mean_d1", (S0,), (S0, S0)),
    ("logsumexp_d0", (S1,), S0),
    ("norm_d1", (S0,), S0),
    ("aminmax_d0", (S0,), (PN, PM)),
    ("aminmax_d0", (S1,), (S0, S0)),
    ("count_nonzero_d0", (S0,), P),
    ("any_d0", (S0,), PM),
    ("all_d1", (S1,), PN),
]
# Mixed layouts on the 2x2 mesh: (case, inputs, outputs), one placement per mesh dim.
EXPECTED_2D = [
    ("mm", ((S0, S1), (R, S0)), (S0, P)),
    ("mm", ((S1, R), (S0, S1)), (P, S1)),
    ("mm", ((S1, S1), (S0, S0)), (P, P)),
    ("mm", ((S0, S0), (R, R)), (S0, S0)),
    ("bmm", ((S0, S2), (S0, S1)), (S0, P)),
    ("addmm_bias1d", ((P, S0), (S1, R), (S0, S1)), (P, S1)),
    ("sum_d0", ((S0, S1),), (P, S0)),
    ("mean_even", ((S0, S1),), (PA, S0)),
    ("mean_d02", ((S2, S0),), (PA, PA)),
    ("amax_even", ((S1, S0),), (S0, PM)),
    ("max_dim", ((S0, S0),), ((S0, S0), (S0, S0))),
]
# Layouts the engine must move (the shortcut would be wrong): (case, inputs, meshes it applies to).
MUST_MOVE = [
    ("mean_uneven", (S0,), ("1d", "2d")),     # local means of unequal chunks
    ("mean_2d_uneven", (S0,), ("2d",)),       # 6 -> 3, 3 -> 2, 1, 2, 1
    ("amax_empty_chunk", (S0,), ("1d",)),     # a max over nothing raises
    ("amax_even", (P,), ("1d", "2d")),        # max does not commute with sum
    ("sum_d0", (PM,), ("1d", "2d")),
    ("argmax_d1", (S1,), ("1d", "2d")),       # indices would be local
    ("argmin_all", (S0,), ("1d", "2d")),
    ("max_dim", (S1,), ("1d", "2d")),
    ("prod_d0", (P,), ("1d", "2d")),       # a product of sums is not a sum of products
    ("var_d1", (S1,), ("1d", "2d")),
    ("var_d1", (P,), ("1d", "2d")),
    ("logsumexp_d0", (S0,), ("1d", "2d")),
    ("mm", (P, P), ("1d", "2d")),             # bilinear: a cross term per pair of ranks
    ("mm", (S1, R), ("1d", "2d")),
    ("mm", (PM, R), ("1d", "2d")),
    ("addmm_bias1d", (R, S1, S0), ("1d", "2d")),  # the bias would be added once per rank
    ("addmm_bias1d", (R, P, R), ("1d", "2d")),
    ("addmm_bias1d", (PM, R, R), ("1d", "2d")),  # beta is a float: its sign is unknown
    ("addmm_beta_neg", (PM, R, R), ("1d", "2d")),  # -max(b) is min(-b)
]


def _call(key, case, layouts, *extra):
    opname, args, kwargs = CASES[case]
    return (key, opname, args, kwargs, layouts, *extra)


def _sweep_calls(mesh_name, cap):
    """Every Replicate/Shard layout combination of every case (and Partial ones on 1-d), capped by sampling."""
    mesh_ndim = len(MESHES[mesh_name])
    rng = random.Random(_seed("sweep", mesh_name))
    calls = []
    for case, (opname, args, kwargs) in CASES.items():
        per_dim = []
        for a in args:
            shape = _shape(a)
            if not shape:  # not a tensor, or 0-d (stays a plain tensor)
                continue
            opts = [R] + [Shard(d) for d in range(len(shape))]
            if mesh_ndim == 1 and a[0] != "bool":
                opts += [P, PM]
            per_dim.append(list(itertools.product(opts, repeat=mesh_ndim)))
        combos = list(itertools.product(*per_dim))
        if len(combos) > cap:
            combos = rng.sample(combos, cap)
        calls += [_call(("sweep", case, c), case, c) for c in combos]
    return calls


def _all_calls(mesh_name):
    n = len(MESHES[mesh_name])
    calls = [_call(("expected", case, ins), case, tuple(_layout(p, n) for p in ins)) for case, ins, _ in EXPECTED]
    if mesh_name == "2d":
        calls += [_call(("expected2d", case, ins), case, ins) for case, ins, _ in EXPECTED_2D]
    calls += [_call(("move", case, ins), case, tuple(_layout(p, n) for p in ins))
              for case, ins, meshes in MUST_MOVE if mesh_name in meshes]
    calls += [_call(("out", case, ins, out), case, tuple(_layout(p, n) for p in ins),
                    ("out", _layout(out, n), out_op)) for case, out_op, ins, out in OUT_CASES]
    calls += [(("inplace", opname, ins), opname, args, {}, tuple(_layout(p, n) for p in ins))
              for opname, args, ins, _ in INPLACE_CASES]
    return calls + _sweep_calls(mesh_name, cap=40 if n == 1 else 24)


# out= calls: (case, its out= overload, inputs, the out tensor's placement = the expected result's)
OUT_CASES = [("mm", "mm.out", (S1, S0), P), ("mm", "mm.out", (S0, R), S0), ("sum_d0", "sum.IntList_out", (S1,), S0),
             ("mean_even", "mean.out", (S0,), PA)]
# In-place: (op, args, inputs, expected result placement = the target's, which must not change)
INPLACE_CASES = [
    ("addmm_.default", [(5, 3), (5, 7), (7, 3)], (S0, S0, R), S0),
    ("addmm_.default", [(5, 3), (5, 7), (7, 3)], (P, S1, S0), P),
    ("addmm_.default", [(5, 3), (5, 7), (7, 3)], (R, S1, S0), R),  # must gather: a P result cannot go in R
    ("baddbmm_.default", [(3, 5, 2), (3, 5, 6), (3, 6, 2)], (S0, S0, S0), S0),
    ("addmv_.default", [(5,), (5, 7), (7,)], (S0, S0, R), S0),
]


class _PerMesh:
    """e2e[mesh]: that mesh's results, gathered on first use (one run_on_ranks call per mesh)."""

    def __init__(self):
        self._results = {}

    def __getitem__(self, mesh):
        if mesh not in self._results:
            self._results[mesh] = _gather(mesh)
        return self._results[mesh]


@pytest.fixture(scope="module")
def e2e():
    return _PerMesh()


def _gather(mesh_name):
    per_rank = run_on_ranks(4, _e2e, MESHES[mesh_name], _all_calls(mesh_name), timeout=900)
    merged = {}
    for key, (outs, moved, problems) in per_rank[0].items():
        for rank, res in enumerate(per_rank[1:], 1):
            if key not in res:
                problems = problems + [f"rank {rank} did not get here"]
            elif res[key][:2] != (outs, moved) or res[key][2]:
                problems = problems + [f"rank {rank}: {res[key]}"]
        merged[key] = (outs, moved, problems)
    return merged


def _result(e2e, mesh, key):
    assert key in e2e[mesh], f"{key} did not run on {mesh} (an earlier call raised: see its failure)"
    outs, moved, problems = e2e[mesh][key]
    assert not problems, f"{key} on {mesh}:\n" + "\n".join(problems)
    return outs, moved


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("case,ins,out", EXPECTED, ids=[f"{c}-{i}" for c, i, _ in EXPECTED])
def test_expected_option_taken(e2e, mesh, case, ins, out):
    """The main options run with no communication and give the placement we expect."""
    n = len(MESHES[mesh])
    outs, moved = _result(e2e, mesh, ("expected", case, ins))
    want = tuple(_layout(p, n) for p in (out if isinstance(out, tuple) else (out,)))
    assert not moved, f"{case} {list(ins)} on {mesh}: redistributed its inputs (result {outs})"
    assert outs == want, f"{case} {list(ins)} on {mesh}: gave {outs}, expected {want}"


@pytest.mark.parametrize("case,ins,out", EXPECTED_2D, ids=[f"{c}-{i}" for c, i, _ in EXPECTED_2D])
def test_expected_option_taken_2d_mixed(e2e, case, ins, out):
    outs, moved = _result(e2e, "2d", ("expected2d", case, ins))
    want = out if isinstance(out[0], tuple) else (out,)
    assert not moved, f"{case} {ins}: redistributed its inputs (result {outs})"
    assert outs == want, f"{case} {ins}: gave {outs}, expected {want}"


@pytest.mark.parametrize("case,ins,meshes", MUST_MOVE, ids=[f"{c}-{i}" for c, i, _ in MUST_MOVE])
def test_unsound_shortcut_not_taken(e2e, case, ins, meshes):
    for mesh in meshes:
        outs, moved = _result(e2e, mesh, ("move", case, ins))  # also: the result is right
        assert moved, f"{case} {list(ins)} on {mesh}: ran on the shards as they were, giving {outs}"


@pytest.mark.parametrize("mesh", list(MESHES))
def test_all_layouts_end_to_end(e2e, mesh):
    """Every (sampled) layout combination of every case gives the plain-torch result."""
    keys = [k for k in e2e[mesh] if k[0] == "sweep"]
    assert len(keys) == len([c for c in _sweep_calls(mesh, cap=40 if mesh == "1d" else 24)]), \
        "the sweep stopped early: " + next((str(v[2]) for v in e2e[mesh].values() if v[0] is None), "")
    failures = [f"{k[1]} {k[2]}: {e2e[mesh][k][2]}" for k in keys if e2e[mesh][k][2]]
    assert not failures, f"{len(failures)} of {len(keys)} layouts failed on {mesh}:\n" + "\n".join(failures[:10])


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("case,out_op,ins,out", OUT_CASES, ids=[f"{o}-{i}" for _, o, i, _ in OUT_CASES])
def test_out_variant(e2e, mesh, case, out_op, ins, out):
    n = len(MESHES[mesh])
    outs, moved = _result(e2e, mesh, ("out", case, ins, out))
    assert outs == (_layout(out, n),) and not moved, f"{case} out=: {outs}, moved={moved}"


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("opname,args,ins,out", INPLACE_CASES, ids=[f"{o}-{i}" for o, _, i, _ in INPLACE_CASES])
def test_inplace(e2e, mesh, opname, args, ins, out):
    n = len(MESHES[mesh])
    outs, moved = _result(e2e, mesh, ("inplace", opname, ins))
    assert outs == (_layout(out, n),), f"{opname} {list(ins)}: the target became {outs}"
    assert moved == (out == R), f"{opname} {list(ins)}: moved={moved}"


# ------------------------------------------------------------------ backward
LOSSES = {"sum": lambda x, y: (x @ y).sum(), "mean0": lambda x, y: (x @ y).mean(0).sum()}


def _backward(mesh_shape):
    """Rank side: grads of losses through DTensors vs plain torch; 'skip: ...' if an op lacks a rule."""
    from shardprop import distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    n = len(mesh_shape)
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(8, 7, generator=gen, dtype=torch.float64), torch.randn(7, 3, generator=gen, dtype=torch.float64)
    out = []
    for (la, lb), (name, loss_of) in itertools.product([(S0, R), (S1, S0), (R, S1)], LOSSES.items()):
        ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
        loss_of(ra, rb).backward()
        da = distribute_tensor(a, mesh, [la] * n).requires_grad_()
        db = distribute_tensor(b, mesh, [lb] * n).requires_grad_()
        try:
            loss_of(da, db).backward()
        except ShardingError as e:
            if "has no sharding rule" in str(e):
                return "skip: " + str(e).split("(inputs")[0]
            raise
        torch.testing.assert_close(da.grad.full_tensor(), ra.grad, msg=f"{name}: grad of a, layouts {la} {lb}")
        torch.testing.assert_close(db.grad.full_tensor(), rb.grad, msg=f"{name}: grad of b, layouts {la} {lb}")
        out.append((name, la, lb))
    return out


@pytest.mark.parametrize("mesh", list(MESHES))
def test_backward(mesh):
    res = run_on_ranks(4, _backward, MESHES[mesh], timeout=300)[0]
    if isinstance(res, str):
        pytest.skip(res)
    assert len(res) == 6
