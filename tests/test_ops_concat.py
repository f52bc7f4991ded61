"""cat and stack (ops/concat.py) on a 4-rank 1-d mesh and a 2x2 mesh.

* Every case runs under every layout shared by all inputs, and under mixed layouts,
  and ``full_tensor()`` is compared with plain torch on the full tensors.
* Expectations derived from the chunk arithmetic, not from the rule: a shard every
  input shares off the cat dim is kept with no collective; a shard on the cat dim is
  gathered; a shared Partial stays Partial; stack moves input dim e to e or e + 1.
* concat/hstack/vstack/dstack/column_stack under inference_mode match torch.
* Backward of split / chunk / unbind (cat / stack of the gradients) matches torch,
  and keeps a shard off the split dim without communication.
* ``check_sharding_rule`` finds no incorrect entry (and none missing) for cat and stack,
  a legacy ``(0,)`` input included.
"""

import itertools

import pytest
import torch

from shardprop import Partial, Replicate, Shard
from tests.rankpool import run_on_ranks

R, P, PMAX = Replicate(), Partial(), Partial("max")
aten = torch.ops.aten

# name -> (input shapes, kind, dim). Sizes 5, 3, 7 do not divide by 2 or 4: uneven shards.
CASES = {
    "cat0 even": ([(8, 6), (4, 6)], "cat", 0),
    "cat1 uneven": ([(5, 3), (5, 6)], "cat", 1),
    "cat-1 3d": ([(3, 5, 2), (3, 5, 7)], "cat", -1),
    "cat0 three uneven": ([(2, 6), (3, 6), (7, 6)], "cat", 0),
    "cat1 3d": ([(4, 2, 3), (4, 5, 3)], "cat", 1),
    "stack0": ([(5, 6)] * 3, "stack", 0),
    "stack1 uneven": ([(3, 7)] * 2, "stack", 1),
    "stack-1 3d": ([(4, 3, 5)] * 2, "stack", -1),
}


def _full(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _op(kind):
    return torch.cat if kind == "cat" else torch.stack


def _layouts(ndim, mesh_ndim):
    return list(itertools.product([R, P, PMAX] + [Shard(e) for e in range(ndim)], repeat=mesh_ndim))


def _forward(mesh_shape):
    """(problems, records): records are (case, input layouts, output placements, collectives)."""
    from shardprop import distribute_tensor, init_device_mesh
    from shardprop.debug.explain import explain
    mesh = init_device_mesh("cpu", mesh_shape)
    problems, records = [], []
    for ci, (name, (shapes, kind, dim)) in enumerate(CASES.items()):
        fulls = [_full(s, 10 * ci + i) for i, s in enumerate(shapes)]
        want = _op(kind)(fulls, dim)
        lays = _layouts(len(shapes[0]), len(mesh_shape))
        shared = [(pl,) * len(shapes) for pl in lays]
        # Mixed: input i takes layout j + 3 i (deterministic, covers redistributed inputs).
        mixed = [tuple(lays[(j + 3 * i) % len(lays)] for i in range(len(shapes))) for j in range(len(lays))]
        for ins in shared + mixed:
            try:
                xs = [distribute_tensor(f, mesh, pl) for f, pl in zip(fulls, ins)]
                with explain() as ex:
                    y = _op(kind)(xs, dim)
                n_coll = sum(len(r.collectives) for r in ex.records)
                if y.shape != want.shape or not torch.allclose(y.full_tensor(), want):
                    problems.append(f"{name} {ins}: wrong result")
                records.append((name, ins, tuple(y.placements), n_coll))
            except Exception as e:  # collected, so one bad case does not hide the others
                problems.append(f"{name} {ins}: {type(e).__name__}: {str(e)[:300]}")
    return problems, records


@pytest.fixture(scope="module", params=[(4,), (2, 2)], ids=["1d", "2x2"])
def forward(request):
    per_rank = run_on_ranks(4, _forward, request.param, timeout=300)
    return request.param, per_rank


def test_matches_torch(forward):
    _, per_rank = forward
    problems = [p for probs, _ in per_rank for p in probs]
    assert not problems, "\n".join(problems[:30])
    recs = per_rank[0][1]
    assert all(r == recs for _, r in per_rank), "ranks disagree on placements"


def _expected(kind, dim, ndim, pl):
    """(allowed output placements, must communicate) of one mesh dim where every input has ``pl``.

    A shard on the cat dim must leave it (the engine may gather it or move it to another dim).
    """
    out_ndim = ndim + (kind == "stack")
    d = dim % out_ndim
    if not pl.is_shard():
        return {pl}, False
    if kind == "stack":
        return {Shard(pl.dim if pl.dim < d else pl.dim + 1)}, False
    if pl.dim == d:
        return {R} | {Shard(e) for e in range(out_ndim) if e != d}, True
    return {pl}, False


def test_shared_layouts(forward):
    mesh_shape, per_rank = forward
    checked = 0
    for name, ins, outs, n_coll in per_rank[0][1]:
        if any(i != ins[0] for i in ins):
            continue
        shapes, kind, dim = CASES[name]
        exp = [_expected(kind, dim, len(shapes[0]), p) for p in ins[0]]
        assert all(o in allowed for o, (allowed, _) in zip(outs, exp)), f"{name} {ins}: got {outs}"
        moves = any(m for _, m in exp)
        assert (n_coll > 0) == moves, f"{name} {ins}: {n_coll} collectives, expected moves={moves}"
        checked += 1
    assert checked == sum(len(_layouts(len(c[0][0]), len(mesh_shape))) for c in CASES.values())


def _legacy_empty(mesh_shape):
    """cat skips (0,) inputs: under any placement they cost nothing and do not stop a shard."""
    from shardprop import distribute_tensor, init_device_mesh
    from shardprop.debug.explain import explain
    mesh = init_device_mesh("cpu", mesh_shape)
    a, b = _full((4, 6), 0), _full((3, 6), 1)
    empty = torch.empty(0, dtype=torch.float64)
    want = torch.cat([empty, a, empty, b], 0)
    out = []
    for e_pl in itertools.product([R, Shard(0), P], repeat=len(mesh_shape)):
        for x_pl in [(Shard(1),) * len(mesh_shape), (R,) * len(mesh_shape)]:
            xs = [distribute_tensor(t, mesh, pl) for t, pl in
                  [(empty, e_pl), (a, x_pl), (empty, (R,) * len(mesh_shape)), (b, x_pl)]]
            with explain() as ex:
                y = torch.cat(xs, 0)
            ok = torch.equal(y.full_tensor(), want)
            out.append((e_pl, x_pl, tuple(y.placements), sum(len(r.collectives) for r in ex.records), ok))
    return out


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d", "2x2"])
def test_legacy_empty_inputs(mesh_shape):
    for e_pl, x_pl, outs, n_coll, ok in run_on_ranks(4, _legacy_empty, mesh_shape)[0]:
        assert ok, f"empty {e_pl}, inputs {x_pl}: wrong result"
        assert outs == x_pl and n_coll == 0, f"empty {e_pl}, inputs {x_pl}: -> {outs} with {n_coll} collectives"


def _out_variants():
    """cat.out / stack.out into a DTensor already laid out as the result."""
    from shardprop import distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (4,))
    a, b = _full((3, 6), 0), _full((3, 6), 1)
    xs = [distribute_tensor(t, mesh, [Shard(1)]) for t in (a, b)]
    res = []
    for fn, want, pl in [(torch.cat, torch.cat([a, b], -2), Shard(1)),
                         (torch.stack, torch.stack([a, b], 1), Shard(2))]:
        out = distribute_tensor(torch.zeros(want.shape, dtype=want.dtype), mesh, [pl])
        r = fn(xs, 1 if fn is torch.stack else -2, out=out)
        res.append((r is out, tuple(out.placements) == (pl,), torch.equal(out.full_tensor(), want)))
    return res


def test_out_variants():
    assert run_on_ranks(4, _out_variants)[0] == [(True, True, True)] * 2


# Composites that reach __torch_dispatch__ themselves under inference_mode: name -> (shapes, fn).
# 1-d inputs to vstack/dstack/column_stack change rank on the way in (atleast_Nd).
INFERENCE = {
    "concat": ([(5, 3), (5, 2)], lambda xs: torch.concat(xs, 1)),
    "concatenate": ([(3, 4), (2, 4)], lambda xs: torch.concatenate(xs, -2)),
    "hstack 2d": ([(5, 3), (5, 2)], torch.hstack),
    "hstack 1d": ([(5,), (3,)], torch.hstack),
    "vstack 2d": ([(3, 5), (2, 5)], torch.vstack),
    "vstack 1d": ([(5,), (5,)], torch.vstack),
    "dstack 3d": ([(3, 5, 1), (3, 5, 2)], torch.dstack),
    "dstack 2d": ([(3, 5), (3, 5)], torch.dstack),
    "column_stack 1d": ([(5,), (5,)], torch.column_stack),
    "column_stack 2d": ([(5, 2), (5, 3)], torch.column_stack),
}


def _inference(mesh_shape):
    from shardprop import distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape)
    problems = []
    with torch.inference_mode():
        for ci, (name, (shapes, fn)) in enumerate(INFERENCE.items()):
            fulls = [_full(sh, 10 * ci + i) for i, sh in enumerate(shapes)]
            want = fn(fulls)
            for pl in _layouts(len(shapes[0]), len(mesh_shape)):
                try:
                    y = fn([distribute_tensor(f, mesh, pl) for f in fulls])
                    if y.shape != want.shape or not torch.allclose(y.full_tensor(), want):
                        problems.append(f"{name} {pl}: wrong result")
                except Exception as e:
                    problems.append(f"{name} {pl}: {type(e).__name__}: {str(e)[:300]}")
    return problems


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d", "2x2"])
def test_inference_mode_composites(mesh_shape):
    problems = run_on_ranks(4, _inference, mesh_shape, timeout=300)[0]
    assert not problems, "\n".join(problems[:30])


# name -> (shape, fn making a list of pieces, split dim). The loss is the sum of the pieces'
# squares weighted by their index, so every piece's gradient differs.
BACKWARD = {
    "split": ((8, 6), lambda x: x.split(2, dim=0), 0),
    "split uneven": ((7, 6), lambda x: x.split(3, dim=0), 0),
    "split sizes": ((5, 6), lambda x: x.split([1, 5], dim=1), 1),
    "chunk": ((6, 5), lambda x: x.chunk(3, dim=-1), 1),
    "unbind": ((3, 8), lambda x: x.unbind(0), 0),
    "unbind last": ((6, 3), lambda x: x.unbind(-1), 1),
}


def _loss(pieces):
    return sum((i + 1) * (p ** 2).sum() for i, p in enumerate(pieces))


def _backward(mesh_shape):
    from shardprop import distribute_tensor, init_device_mesh
    from shardprop.debug.explain import explain
    mesh = init_device_mesh("cpu", mesh_shape)
    problems, kept = [], 0
    for ci, (name, (shape, fn, d)) in enumerate(BACKWARD.items()):
        full = _full(shape, ci)
        ref = full.clone().requires_grad_(True)
        (g_ref,) = torch.autograd.grad(_loss(fn(ref)), ref)
        for pl in itertools.product([R] + [Shard(e) for e in range(len(shape))], repeat=len(mesh_shape)):
            try:
                x = distribute_tensor(full, mesh, pl).requires_grad_(True)
                pieces = fn(x)
                loss = _loss(pieces)
                with explain() as ex:
                    (g,) = torch.autograd.grad(loss, x)
                if not torch.allclose(g.full_tensor(), g_ref):
                    problems.append(f"{name} {pl}: wrong gradient")
                joins = [r for r in ex.records if r.op in ("aten.cat.default", "aten.stack.default")]
                if not joins:
                    problems.append(f"{name} {pl}: no cat/stack in backward: {[r.op for r in ex.records]}")
                # A shard off the split dim: the pieces' gradients keep it, and the join moves nothing.
                if all(p.is_shard() and p.dim != d for p in pl):
                    kept += 1
                    if tuple(g.placements) != pl or any(r.collectives for r in joins):
                        problems.append(f"{name} {pl}: gradient {tuple(g.placements)}, "
                                        f"join collectives {[r.collectives for r in joins]}")
            except Exception as e:
                problems.append(f"{name} {pl}: {type(e).__name__}: {str(e)[:300]}")
    if not kept:
        problems.append("no layout sharded off the split dim was tried")
    return problems


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d", "2x2"])
def test_backward_of_split_chunk_unbind(mesh_shape):
    problems = run_on_ranks(4, _backward, mesh_shape, timeout=300)[0]
    assert not problems, "\n".join(problems[:30])


def _check(mesh_shape):
    """check_sharding_rule summaries: (name, incorrect, missing, errors, accepted)."""
    import shardprop
    from shardprop import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape)
    cap = None if len(mesh_shape) == 1 else 400
    samples = [
        ("cat dim 1", aten.cat.default, ([_full((5, 3), 0), _full((5, 2), 1)], 1)),
        ("cat dim -2", aten.cat.default, ([_full((3, 4), 2), _full((2, 4), 3)], -2)),
        ("stack dim 1", aten.stack.default, ([_full((5, 3), 4), _full((5, 3), 5)], 1)),
        ("stack dim -1", aten.stack.default, ([_full((3, 6), 6), _full((3, 6), 7)], -1)),
    ]
    if len(mesh_shape) == 1:  # three inputs: 343 layouts on a 1-d mesh
        samples.append(("cat legacy empty", aten.cat.default,
                        ([_full((5, 3), 8), torch.empty(0, dtype=torch.float64), _full((2, 3), 9)], 0)))
    out = []
    for name, op, args in samples:
        rep = shardprop.check_sharding_rule(op, *args, mesh=mesh, max_combos=cap)
        out.append((name, [str(f) for f in rep.incorrect], [str(f) for f in rep.missing],
                    [f"{f}: {f.message}" for f in rep.errors], len(rep.accepted)))
    return out


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d", "2x2"])
def test_check_sharding_rule(mesh_shape):
    for name, incorrect, missing, errors, accepted in run_on_ranks(4, _check, mesh_shape, timeout=300)[0]:
        assert not incorrect, f"{name}: incorrect {incorrect[:10]}"
        assert not errors, f"{name}: errors {errors[:10]}"
        assert not missing, f"{name}: missing {missing[:10]}"
        assert accepted, f"{name}: nothing accepted"
