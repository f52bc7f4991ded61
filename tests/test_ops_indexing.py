"""Indexing ops (ops/indexing.py) and plain index tensors (shardprop/dispatch.py) on 4 ranks.

* ``check_sharding_rule`` walks every input layout (R, each S(d), and the four
  Partials for floating inputs) of a sample call of each op on a 4-rank mesh and a
  2x2 mesh: no option the rules give may be incorrect, and the shard-keeping
  options this module is for must be accepted (so a rule that only replicates fails).
  Sizes 5 and 7 give uneven shards.
* Advanced indexing from Python (``x[idx]``, ``x[:, idx]``, ``x[i, :, j]``, lists,
  bool masks, ``x[idx] = v``) matches plain torch and keeps the expected shards.
* Backward of gather / index_select / advanced indexing / scatter_add on sharded
  inputs matches plain torch.
* A plain integer tensor mixed with DTensors is taken as replicated; a plain floating
  one still raises the message that says how to fix it.
"""

import pytest
import torch
import torch.distributed as dist

from shardprop import Partial, Replicate, Shard
from tests.rankpool import run_on_ranks

aten = torch.ops.aten
R = Replicate()
PSUM = Partial("sum")


def _f(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _i(high, *shape, seed=0):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _perm(n, k, seed=0):
    """``k`` distinct indices below ``n`` (index_copy / put need no duplicates to be deterministic)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k]


# name -> (op, args, kwargs, layouts that must be accepted: (input placements, output placement) on 1-d)
def _samples():
    x = _f(7, 6, seed=1)
    return {
        "index_select dim0": (aten.index_select.default, (x, 0, _i(7, 5, seed=2)), {},
                              [((Shard(1), R), Shard(1)), ((R, Shard(0)), Shard(0)), ((PSUM, R), PSUM)]),
        "index_select dim-1": (aten.index_select.default, (x, -1, _i(6, 9, seed=3)), {},
                               [((Shard(0), R), Shard(0)), ((R, Shard(0)), Shard(1))]),
        "gather dim1": (aten.gather.default, (x, 1, _i(6, 7, 4, seed=4)), {},
                        [((Shard(0), Shard(0)), Shard(0)), ((R, Shard(1)), Shard(1))]),
        "gather dim0 short index": (aten.gather.default, (x, 0, _i(7, 3, 6, seed=5)), {},
                                    [((Shard(1), Shard(1)), Shard(1)), ((R, Shard(0)), Shard(0))]),
        "scatter src": (aten.scatter.src, (x, 1, _i(6, 7, 3, seed=6), _f(7, 3, seed=7)), {},
                        [((Shard(0), Shard(0), Shard(0)), Shard(0))]),
        "scatter value": (aten.scatter.value, (x, 0, _i(7, 7, 6, seed=8), 1.5), {},
                          [((Shard(1), Shard(1)), Shard(1))]),
        "scatter_add": (aten.scatter_add.default, (x, 1, _i(6, 7, 3, seed=9), _f(7, 3, seed=10)), {},
                        [((Shard(0), Shard(0), Shard(0)), Shard(0)), ((PSUM, R, PSUM), PSUM)]),
        "scatter_reduce amax": (aten.scatter_reduce.two, (x, 0, _i(7, 7, 6, seed=11), _f(7, 6, seed=12), "amax"),
                                {"include_self": False}, [((Shard(1), Shard(1), Shard(1)), Shard(1))]),
        "scatter_reduce sum": (aten.scatter_reduce.two, (x, 0, _i(7, 7, 6, seed=13), _f(7, 6, seed=14), "sum"),
                               {}, [((PSUM, R, PSUM), PSUM)]),
        "index_add": (aten.index_add.default, (x, 0, _i(7, 5, seed=15), _f(5, 6, seed=16)), {"alpha": 2},
                      [((Shard(1), R, Shard(1)), Shard(1)), ((PSUM, R, PSUM), PSUM)]),
        "index_copy": (aten.index_copy.default, (x, 1, _perm(6, 4, seed=17), _f(7, 4, seed=18)), {},
                       [((Shard(0), R, Shard(0)), Shard(0))]),
        "index_fill": (aten.index_fill.int_Scalar, (x, -1, _i(6, 3, seed=19), -2.5), {},
                       [((Shard(0), R), Shard(0)), ((Partial("max"), R), Partial("max"))]),
        "index_reduce prod": (aten.index_reduce.default, (x, 0, _i(7, 5, seed=20), _f(5, 6, seed=21), "prod"), {},
                              [((Shard(1), R, Shard(1)), Shard(1))]),
        "index adjacent": (aten.index.Tensor, (_f(5, 7, 6, seed=22), [None, _i(7, 4, seed=23)]), {},
                           [((Shard(0), R), Shard(0)), ((Shard(2), R), Shard(2)), ((R, Shard(0)), Shard(1))]),
        "index apart": (aten.index.Tensor, (_f(5, 7, 6, seed=24), [_i(5, 4, seed=25), None, _i(6, 4, seed=26)]),
                        {}, [((Shard(1), R, R), Shard(1)), ((R, Shard(0), Shard(0)), Shard(0))]),
        "index_put": (aten.index_put.default, (x, [_perm(7, 3, seed=27)], _f(3, 6, seed=28)), {},
                      [((Shard(1), R, Shard(1)), Shard(1))]),
        "index_put accumulate": (aten.index_put.default, (x, [None, _i(6, 5, seed=29)], _f(5, seed=30), True),
                                 {}, [((Shard(0), R, R), Shard(0)), ((PSUM, R, PSUM), PSUM)]),
        "take": (aten.take.default, (x, _i(42, 5, 3, seed=31)), {}, [((R, Shard(1)), Shard(1))]),
        "put accumulate": (aten.put.default, (x, _i(42, 9, seed=32), _f(9, seed=33), True), {},
                           [((PSUM, R, PSUM), PSUM)]),
        "masked_scatter": (aten.masked_scatter.default, (x, _f(7, 6, seed=34) > 0, _f(7, 6, seed=35)), {}, []),
    }


def _check(mesh_shape, names, max_combos):
    """Per sample: (name, incorrect, errors, must-have layouts not accepted, accepted count)."""
    import shardprop
    from shardprop import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape)
    out = []
    for name, (op, args, kwargs, must) in _samples().items():
        if name not in names:
            continue
        reps = [shardprop.check_sharding_rule(op, *args, mesh=mesh, max_combos=max_combos, **kwargs)]
        absent = []
        if len(mesh_shape) == 1 and must:
            reps.append(shardprop.check_sharding_rule(op, *args, mesh=mesh, input_layouts=[i for i, _ in must],
                                                      **kwargs))
            absent = [(ins, o) for ins, o in must if reps[-1].find("accepted", ins, o) is None]
        out.append((name, [str(f) for r in reps for f in r.incorrect],
                    [f"{f}: {f.message}" for r in reps for f in r.errors],
                    [str(a) for a in absent], sum(len(r.accepted) for r in reps)))
    return out


_NAMES = list(_samples())


# A deterministic sample of the layouts keeps this under a minute; an exhaustive run
# (max_combos=None) of every case found nothing incorrect when the rules were written.
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d", "2x2"])
def test_check_sharding_rule(mesh_shape):
    names = _NAMES if len(mesh_shape) == 1 else ["gather dim1", "scatter_add", "index adjacent", "index_put accumulate"]
    results = run_on_ranks(4, _check, mesh_shape, names, 8 if len(mesh_shape) == 1 else 12, timeout=300)[0]
    for name, incorrect, errors, absent, accepted in results:
        assert not incorrect, f"{name}: incorrect {incorrect[:5]}"
        assert not errors, f"{name}: errors {errors[:5]}"
        assert not absent, f"{name}: not accepted {absent}"
        assert accepted, f"{name}: nothing accepted"


# ---------------------------------------------------------------- Python indexing
def _python_indexing():
    from shardprop import distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (4,))
    full = _f(6, 8, 5, seed=40)
    idx = _i(8, 4, seed=41)
    mask = _f(6, 8, 5, seed=42) > 0
    rows = _f(6, seed=43) > 0
    cases = [  # (what, input placement, function, expected output placement or None for any)
        ("x[idx] S(2)", Shard(2), lambda x, I: x[I], Shard(2)),
        ("x[:, idx] S(0)", Shard(0), lambda x, I: x[:, I], Shard(0)),
        ("x[idx, :, idx] S(1)", Shard(1), lambda x, I: x[I % 5, :, I % 5], Shard(1)),
        ("x[[1, 4, 2]] S(1)", Shard(1), lambda x, I: x[[1, 4, 2]], Shard(1)),
        ("x[:, [0, 7]] S(2)", Shard(2), lambda x, I: x[:, [0, 7]], Shard(2)),
        ("x[mask] S(0)", Shard(0), lambda x, I: x[I], None),
        ("x[rows] S(1)", Shard(1), lambda x, I: x[I], Shard(1)),
        ("x[-1, idx] S(2)", Shard(2), lambda x, I: x[-1, I], Shard(1)),
    ]
    problems = []
    for what, pl, fn, want_pl in cases:
        x = distribute_tensor(full, mesh, [pl])
        if "mask" in what:
            ind_full, ind = mask, distribute_tensor(mask, mesh, [Shard(0)])
        elif "rows" in what:
            ind_full, ind = rows, rows  # a plain bool tensor
        else:
            ind_full, ind = idx, distribute_tensor(idx, mesh, [R])
        try:
            got = fn(x, ind)
            torch.testing.assert_close(got.full_tensor(), fn(full, ind_full), msg=what)
            if want_pl is not None and tuple(got.placements) != (want_pl,):
                problems.append(f"{what}: placements {got.placements}, want {want_pl}")
        except Exception as e:  # noqa: BLE001 - reported per case
            problems.append(f"{what}: {type(e).__name__}: {e}")
    # Writes: x[idx] = v (index_put_), masked fill through a bool mask, accumulate.
    x = distribute_tensor(full.clone(), mesh, [Shard(2)])
    want = full.clone()
    vals = _f(3, 8, 5, seed=44)
    sel = torch.tensor([5, 0, 2])
    x[sel] = distribute_tensor(vals, mesh, [Shard(2)])
    want[sel] = vals
    # A basic index on an unsharded dim stays a view of the shards, so the write lands in x.
    x[torch.tensor([1, 1, 3]), 2] = 7.0
    want[torch.tensor([1, 1, 3]), 2] = 7.0
    if tuple(x.placements) != (Shard(2),):
        problems.append(f"setitem changed placements to {x.placements}")
    try:
        torch.testing.assert_close(x.full_tensor(), want, msg="setitem")
    except AssertionError as e:
        problems.append(str(e))
    y = distribute_tensor(full.clone(), mesh, [Shard(1)])
    y[rows] = 0.0  # a bool mask over dim 0: the shard on dim 1 stays
    if tuple(y.placements) != (Shard(1),):
        problems.append(f"mask setitem changed placements to {y.placements}")
    w = full.clone()
    w[rows] = 0.0
    try:
        torch.testing.assert_close(y.full_tensor(), w, msg="mask setitem")
    except AssertionError as e:
        problems.append(str(e))
    return problems


def test_python_indexing():
    for problems in run_on_ranks(4, _python_indexing, timeout=120):
        assert not problems, problems


# ---------------------------------------------------------------- backward
def _backward():
    from shardprop import distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (4,))
    x_full = _f(7, 6, seed=50)
    cases = [  # (what, x placement, index full, index placement, fn)
        ("gather dim1", Shard(0), _i(6, 7, 9, seed=51), Shard(0), lambda x, i: torch.gather(x, 1, i)),
        ("gather index sharded", R, _i(7, 9, 6, seed=52), Shard(0), lambda x, i: torch.gather(x, 0, i)),
        ("index_select", Shard(1), _i(7, 10, seed=53), R, lambda x, i: torch.index_select(x, 0, i)),
        ("index_select index sharded", R, _i(6, 9, seed=54), Shard(0), lambda x, i: x.index_select(-1, i)),
        ("x[i] sharded", Shard(1), _i(7, 5, seed=55), R, lambda x, i: x[i]),
        ("x[:, i] index sharded", R, _i(6, 8, seed=56), Shard(0), lambda x, i: x[:, i]),
        ("take_along_dim", Shard(0), _i(6, 7, 3, seed=57), Shard(0), lambda x, i: torch.take_along_dim(x, i, 1)),
        ("scatter_add", Shard(1), _i(7, 4, 6, seed=58), Shard(1),
         lambda x, i: x.new_zeros(7, 6).scatter_add(0, i, x[:4])),
    ]
    problems = []
    for what, xp, i_full, ip, fn in cases:
        xr = x_full.clone().requires_grad_(True)
        want = fn(xr, i_full)
        g_full = _f(*want.shape, seed=59)
        want.backward(g_full)
        x = distribute_tensor(x_full, mesh, [xp]).requires_grad_(True)
        i = distribute_tensor(i_full, mesh, [ip])
        try:
            out = fn(x, i)
            torch.testing.assert_close(out.full_tensor(), want.detach(), msg=f"{what} forward")
            out.backward(distribute_tensor(g_full, mesh, list(out.placements))
                         if all(type(p) is not Partial for p in out.placements)
                         else distribute_tensor(g_full, mesh, [R]))
            torch.testing.assert_close(x.grad.full_tensor(), xr.grad, msg=f"{what} grad")
        except Exception as e:  # noqa: BLE001 - reported per case
            problems.append(f"{what}: {type(e).__name__}: {e}")
    return problems


def test_backward():
    for problems in run_on_ranks(4, _backward, timeout=120):
        assert not problems, problems


# ---------------------------------------------------------------- plain tensors
def _plain_tensors():
    from shardprop import ShardingError, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (4,))
    full = _f(8, 4, seed=60)
    x = distribute_tensor(full, mesh, [Shard(1)])
    problems = []
    got = torch.index_select(x, 0, torch.tensor([3, 0, 3]))  # a plain int64 index tensor
    torch.testing.assert_close(got.full_tensor(), full[[3, 0, 3]])
    if tuple(got.placements) != (Shard(1),):
        problems.append(f"plain index: placements {got.placements}")
    got = x + torch.arange(4)  # plain integer operand, broadcast: replicated
    torch.testing.assert_close(got.full_tensor(), full + torch.arange(4))
    got = x + torch.ones(4)  # a plain float tensor identical on every rank (verified): replicated
    torch.testing.assert_close(got.full_tensor(), full + 1)
    try:
        x + torch.full((4,), float(dist.get_rank()))  # differs between ranks: raises on every rank
        problems.append("a plain float tensor that differs between ranks did not raise")
    except ShardingError as e:
        if "plain torch.Tensor of shape (4,)" not in str(e) or "distribute_tensor" not in str(e):
            problems.append(f"unclear message: {e}")
    try:
        torch.index_add(x, 0, torch.tensor([1]), torch.full((1, 4), float(dist.get_rank())))
        problems.append("a plain float source did not raise")
    except ShardingError:
        pass
    return problems


def test_plain_tensors():
    for problems in run_on_ranks(4, _plain_tensors, timeout=60):
        assert not problems, problems
