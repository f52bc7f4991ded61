"""``_foreach_*`` ops (ops/foreach.py), the optimizers and clip_grad_norm_ on DTensor params.

* Every registered foreach overload (functional and in-place) runs on lists whose
  elements are placed differently (sharded, uneven, replicated, Partial) and matches
  the same op on plain tensors; in-place ops keep each target's placements.
* SGD (momentum, nesterov, dampening, weight_decay) and AdamW (amsgrad off/on,
  weight_decay), foreach=True and False, 5 steps on DTensor params sharded various ways
  on a 4-rank 1-d mesh and a 2x2 mesh, give the parameters of a plain run (atol 1e-5).
* clip_grad_norm_ (foreach and not, norm 2 and inf) gives torch's total norm and grads.
"""

import pytest
import torch

from shardprop import Partial, Replicate, Shard
from tests.rankpool import run_on_ranks

R, P = Replicate(), Partial()
SHAPES = [(8, 6), (5,), (3, 4)]


def _layouts(mesh_ndim):
    """Per list position placements: self-list, other-lists (different, so inputs move)."""
    if mesh_ndim == 1:
        return ([(Shard(0),), (Shard(0),), (Shard(1),)], [(R,), (P,), (Shard(0),)])
    return ([(Shard(0), Shard(1)), (R, Shard(0)), (Shard(1), R)], [(Shard(1), R), (Shard(0), P), (R, R)])


def _fulls(seed, n_lists):
    g = torch.Generator().manual_seed(seed)
    return [[torch.rand(s, generator=g, dtype=torch.float64) * 0.8 + 0.1 for s in SHAPES] for _ in range(n_lists)]


def _scalar_for(op, name):
    if "ord" in name:
        return 2
    if op.overloadpacket.__name__.startswith("_foreach_pow") and name == "self":
        return 1.5
    return 0.7


def _build_args(op, fulls, dist_fn, mesh_ndim):
    """Positional args and kwargs of ``op``: lists from ``fulls``, scalars by type."""
    args, kwargs = [], {}
    lst = 0
    for a in op._schema.arguments:
        t = str(a.type)
        if t == "List[Tensor]":
            v = [dist_fn(f, lst, i) for i, f in enumerate(fulls[lst])]
            lst += 1
        elif t == "List[number]":
            v = [0.3 + 0.2 * i for i in range(len(SHAPES))]
        elif t == "number":
            v = _scalar_for(op, a.name) if a.name != "alpha" else 0.5
        elif t == "Tensor":
            v = dist_fn(torch.tensor(0.6, dtype=torch.float64), -1, 0)
        elif t == "bool":
            v = False
        elif a.has_default_value():
            continue
        else:
            raise AssertionError(f"{op}: unexpected argument type {t}")
        (kwargs.__setitem__(a.name, v) if a.kwarg_only else args.append(v))
    return args, kwargs


def _n_lists(op):
    return sum(str(a.type) == "List[Tensor]" for a in op._schema.arguments)


def _all_foreach(mesh_shape):
    from shardprop.ops.foreach import FOREACH_OPS
    from shardprop import DTensor, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape)
    self_l, other_l = _layouts(len(mesh_shape))
    problems, checked = [], 0
    for k, op in enumerate(FOREACH_OPS):
        fulls = _fulls(k, _n_lists(op))

        def dist_fn(f, lst, i):
            if lst < 0:  # a 0-d tensor operand: a replicated DTensor
                return distribute_tensor(f, mesh, [R] * len(mesh_shape))
            pl = self_l[i] if lst == 0 else other_l[i]
            if op.overloadpacket.__name__.endswith("_") and lst == 0 and any(p.is_partial() for p in pl):
                pl = [R] * len(mesh_shape)
            return distribute_tensor(f, mesh, list(pl))

        plain_args, plain_kw = _build_args(op, [[f.clone() for f in fl] for fl in fulls],
                                           lambda f, lst, i: f, len(mesh_shape))
        args, kwargs = _build_args(op, fulls, dist_fn, len(mesh_shape))
        try:
            want = op(*plain_args, **plain_kw)
            got = op(*args, **kwargs)
            if want is None:  # in-place: compare the written lists
                want, got = plain_args[0], args[0]
                before = [dist_fn(f, 0, i).placements for i, f in enumerate(fulls[0])]
                if [g.placements for g in got] != before:
                    problems.append(f"{op}: in-place target changed placements")
            for w, g in zip(want, got):
                if not isinstance(g, DTensor):
                    problems.append(f"{op}: element is {type(g).__name__}, not a DTensor")
                    continue
                torch.testing.assert_close(g.full_tensor(), w, atol=1e-10, rtol=1e-10, equal_nan=True)
            checked += 1
        except Exception as e:
            problems.append(f"{op}: {type(e).__name__}: {str(e)[:300]}")
    return problems, checked


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d", "2x2"])
def test_every_foreach_op_matches_torch(mesh_shape):
    from shardprop.ops.foreach import FOREACH_OPS
    per_rank = run_on_ranks(4, _all_foreach, mesh_shape, timeout=300)
    problems, checked = per_rank[0]
    assert not problems, "\n".join(problems[:30])
    assert checked == len(FOREACH_OPS) and checked > 100


# ------------------------------------------------------------ optimizers
PARAM_SHAPES = [(8, 6), (8,), (5, 8), (5,), (3, 5)]
PARAM_LAYOUTS = {
    (4,): [(Shard(0),), (Shard(0),), (Shard(1),), (R,), (Shard(0),)],  # (3, 5) S(0): uneven, one empty shard
    (2, 2): [(Shard(0), Shard(1)), (Shard(0), R), (R, Shard(0)), (Shard(0), Shard(0)), (R, R)],
}
OPTIMIZERS = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, maximize=True)),
    ("AdamW", dict(lr=0.05, weight_decay=0.01)),
    ("AdamW", dict(lr=0.05, amsgrad=True, weight_decay=0.01)),
]


def _init_and_grads(steps):
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in PARAM_SHAPES]
    grads = [[torch.randn(s, generator=g) for s in PARAM_SHAPES] for _ in range(steps)]
    return init, grads


def _run(make_params, to_grad, opt_name, kw, foreach, steps=5, clip=None):
    init, grads = _init_and_grads(steps)
    params = make_params(init)
    opt = getattr(torch.optim, opt_name)(params, foreach=foreach, **kw)
    norms = []
    for s in range(steps):
        for p, gr, i in zip(params, grads[s], range(len(params))):
            p.grad = to_grad(gr, i)
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type=clip, foreach=foreach))
        opt.step()
    return params, norms


def _optimizers(mesh_shape):
    from shardprop import distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape)
    layouts = PARAM_LAYOUTS[mesh_shape]
    problems = []

    def make_dparams(init):
        return [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, list(pl))) for t, pl in zip(init, layouts)]

    def make_plain(init):
        return [torch.nn.Parameter(t.clone()) for t in init]

    cases = [(o, kw, fe, None) for o, kw in OPTIMIZERS for fe in (True, False)]
    cases += [("SGD", dict(lr=0.1, momentum=0.9), fe, clip) for fe in (True, False) for clip in (2.0, float("inf"))]
    for opt_name, kw, foreach, clip in cases:
        tag = f"{opt_name} {kw} foreach={foreach} clip={clip}"
        try:
            want, want_norms = _run(make_plain, lambda g, i: g, opt_name, kw, foreach, clip=clip)
            got, got_norms = _run(make_dparams, lambda g, i: distribute_tensor(g, mesh, list(layouts[i])),
                                  opt_name, kw, foreach, clip=clip)
            for i, (w, g) in enumerate(zip(want, got)):
                if g.placements != tuple(layouts[i]):
                    problems.append(f"{tag}: parameter placements changed to {g.placements}")
                torch.testing.assert_close(g.detach().full_tensor(), w.detach(), atol=1e-5, rtol=1e-5)
            for w, g in zip(want_norms, got_norms):
                torch.testing.assert_close(g.full_tensor(), w, atol=1e-5, rtol=1e-5)
        except Exception as e:
            problems.append(f"{tag}: {type(e).__name__}: {str(e)[:400]}")
    return problems, len(cases)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d", "2x2"])
def test_optimizers_match_plain_run(mesh_shape):
    per_rank = run_on_ranks(4, _optimizers, mesh_shape, timeout=300)
    problems, n = per_rank[0]
    assert not problems, "\n".join(problems[:20])
    assert n == 2 * len(OPTIMIZERS) + 4


# ------------------------------------------------------------ shared 0-d operands
def _shared_scalar_cases():
    """0-d operands shared by every list position: plain, replicated, Partial, and wanted differently."""
    from shardprop import distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (4,))
    g = torch.Generator().manual_seed(3)
    fulls = [torch.randn(8, 3, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)]
    s = torch.tensor(1.7, dtype=torch.float64)
    aten = torch.ops.aten
    problems = []
    cases = [
        ("plain 0-d", aten._foreach_add.Tensor, [[Shard(0)], [Shard(0)]], s, None),
        ("replicated 0-d", aten._foreach_mul.Tensor, [[Shard(0)], [R]], s, [R]),
        ("partial 0-d, in-place", aten._foreach_mul_.Tensor, [[Shard(1)], [Shard(0)]], s, [P]),
        # position 0 would keep P + P; position 1 needs the scalar whole: one placement must serve both
        ("partial 0-d, conflicting", aten._foreach_add.Tensor, [[P], [Shard(0)]], s, [P]),
    ]
    for name, op, pls, scalar, spl in cases:
        try:
            xs = [distribute_tensor(f.clone(), mesh, pl) for f, pl in zip(fulls, pls)]
            other = scalar if spl is None else distribute_tensor(scalar, mesh, spl)
            res = op(xs, other)
            want = op([f.clone() for f in fulls], scalar)
            if res is None:
                res, want = xs, [f * scalar for f in fulls]
            for i, (r, w) in enumerate(zip(res, want)):
                torch.testing.assert_close(r.full_tensor(), w)
                if op._schema.arguments[0].alias_info is not None and tuple(r.placements) != tuple(pls[i]):
                    problems.append(f"{name}: in-place target moved to {r.placements}")
        except Exception as e:
            problems.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
    return problems


def test_shared_scalar_operands():
    problems = run_on_ranks(4, _shared_scalar_cases, timeout=120)[0]
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------ _foreach_norm
def _norm_cases(mesh_shape):
    """_foreach_norm on shards (uneven, an empty shard), replicas and Partials, for several ords:
    torch's values, replicated results, and only all-reduces (one per group of shard dims)."""
    from shardprop import distribute_tensor, init_device_mesh
    from shardprop.mesh.collectives import comm_counter
    mesh = init_device_mesh("cpu", mesh_shape)
    n = len(mesh_shape)
    g = torch.Generator().manual_seed(5)
    fulls = [torch.randn(s, generator=g, dtype=torch.float64) for s in [(3, 5), (8, 2), (7,), (4, 4)]]
    if n == 1:
        pls = [[Shard(0)], [Shard(1)], [R], [P]]
    else:
        pls = [[Shard(0), Shard(1)], [R, Shard(0)], [Shard(0), R], [P, Shard(1)]]
    problems, kinds = [], set()
    for ord_ in (2, 1, 3.0, float("inf"), float("-inf"), 0):
        try:
            xs = [distribute_tensor(f, mesh, pl) for f, pl in zip(fulls, pls)]
            with comm_counter() as c:
                got = torch._foreach_norm(xs, ord_)
            want = torch._foreach_norm(fulls, ord_)
            kinds.update(c.counts)
            for gt, w, pl in zip(got, want, pls):
                if any(not p.is_replicate() for p in gt.placements):
                    problems.append(f"ord {ord_}: result placed {gt.placements}")
                torch.testing.assert_close(gt.full_tensor(), w)
        except Exception as e:
            problems.append(f"ord {ord_}: {type(e).__name__}: {str(e)[:300]}")
    return problems, sorted(kinds)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d", "2x2"])
def test_foreach_norm_reduces_without_gathering(mesh_shape):
    problems, kinds = run_on_ranks(4, _norm_cases, mesh_shape, timeout=120)[0]
    assert not problems, "\n".join(problems)
    assert kinds == ["all_reduce"], kinds  # the Partial's reduction and the norms' combination
