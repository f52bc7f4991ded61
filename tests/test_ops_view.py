"""View ops (ops/view.py, ops/dim_maps.py): dim maps, the keep-or-replicate rule, and
real DTensors on a 4-rank 1-d mesh and a 2x2 mesh.

* Pure tests simulate every rank in one process (``local_shape_and_offset`` cuts the
  pieces): for many reshapes and layouts, what the rule keeps must give each rank
  exactly its chunk of the global result, and on 1-d meshes what it replicates must
  be impossible to keep (the chunk condition is exact, not just sufficient).
* Rank tests run every case of ``CASES`` under every Replicate/Shard/Partial layout
  and compare ``full_tensor()`` with plain torch; hand-derived expectations say where
  shards must be kept without communication and where they must be replicated.
"""

import itertools
import math

import pytest
import torch

from shardprop import Partial, Replicate, Shard
from shardprop.tensor.layout import local_shape_and_offset
from shardprop.ops import dim_maps as dm
from tests.rankpool import run_on_ranks

S0, S1, S2, R, P = Shard(0), Shard(1), Shard(2), Replicate(), Partial()
aten = torch.ops.aten

# ---------------------------------------------------------------- pure: dim maps


def test_view_map_groups():
    assert dm.view_map((8, 6), (48,)) == (dm.Flatten((0, 1)),)
    assert dm.view_map((6, 8), (6, 2, 4)) == (dm.Same(0), dm.Split(dm.Same(1), (2, 4), 0),
                                              dm.Split(dm.Same(1), (2, 4), 1))
    assert dm.view_map((4, 1, 6), (4, 6)) == (dm.Same(0), dm.Same(2))
    assert dm.view_map((4, 6), (1, 4, 6, 1)) == (dm.Singleton(), dm.Same(0), dm.Same(1), dm.Singleton())
    f = dm.Flatten((0, 1))
    assert dm.view_map((4, 6), (3, 8)) == (dm.Split(f, (3, 8), 0), dm.Split(f, (3, 8), 1))
    assert dm.view_map((0, 6), (6, 0)) == (dm.Fresh(6), dm.Fresh(0))


def test_other_maps():
    for src, dst in [((0,), (2,)), ((2, 0), (0, 1)), ((-1,), (0,))]:
        moved = torch.empty(2, 3, 4).movedim(src, dst).shape  # distinct sizes: each names its dim
        assert dm.movedim_perm(3, src, dst) == tuple((2, 3, 4).index(s) for s in moved)
    assert dm.expand_map((4, 1), (3, 4, 6)) == (dm.Broadcast(None, 3), dm.Same(0), dm.Broadcast(1, 6))
    assert dm.squeeze_map((4, 1, 6)) == (dm.Same(0), dm.Same(2))
    assert dm.squeeze_map((4, 1, 6), (0,)) == (dm.Same(0), dm.Same(1), dm.Same(2))  # size 4: no-op
    assert dm.cut_map((4, 6), (4,), 1, keepdim=False) == (dm.Same(0),)
    assert dm.embed_map((4, 2), (4, 6), 1) == (dm.Same(0), dm.Resized(1))


def _piece(t, mesh_shape, coord, placements):
    shape, off = local_shape_and_offset(t.shape, mesh_shape, coord, placements)
    for d, (o, n) in enumerate(zip(off, shape)):
        t = t.narrow(d, o, n)
    return t


def _reshape_layout_ok(in_shape, out_shape, mesh_shape, ins, outs) -> bool:
    """Whether reshaping every rank's piece (cut by ``ins``) gives its piece of the result (``outs``)."""
    full = torch.arange(math.prod(in_shape)).reshape(in_shape)
    res = full.reshape(out_shape)
    for coord in itertools.product(*[range(k) for k in mesh_shape]):
        local = _piece(full, mesh_shape, coord, ins)
        want = _piece(res, mesh_shape, coord, outs)
        if local.numel() != want.numel() or not torch.equal(local.reshape(want.shape), want):
            return False
    return True


def _factorizations(n, max_len=3):
    out = []

    def rec(rem, cur):
        if rem == 1 and cur:
            out.append(tuple(cur))
        if len(cur) < max_len:
            for f in range(2, rem + 1):
                if rem % f == 0:
                    rec(rem // f, cur + [f])
    rec(n, [])
    return out + [s[:1] + (1,) + s[1:] for s in out if len(s) < max_len]


@pytest.mark.parametrize("numel", [6, 12, 15, 16, 24])
def test_reshape_rule_exact(numel):
    """Every kept shard is right on every rank; on 1-d meshes no replicated shard could be kept."""
    shapes = _factorizations(numel)
    wrong, missed = [], []
    for a, b in itertools.product(shapes, shapes):
        m = dm.view_map(a, b)
        carrier = {}
        for o, e in enumerate(m):
            c = dm._carried(e, a)
            if c is not None:
                carrier[c[0]] = o
        for mesh_shape in [(2,), (3,), (4,), (2, 2), (3, 2)]:
            for pl in itertools.product([R] + [Shard(d) for d in range(len(a))], repeat=len(mesh_shape)):
                ins, (outs,) = dm.map_placements([m], a, mesh_shape, pl)
                if not _reshape_layout_ok(a, b, mesh_shape, ins, outs):
                    wrong.append((a, b, mesh_shape, pl, outs))
                if len(mesh_shape) == 1 and ins != pl and pl[0].dim in carrier:
                    if _reshape_layout_ok(a, b, mesh_shape, pl, (Shard(carrier[pl[0].dim]),)):
                        missed.append((a, b, mesh_shape, pl))
    assert not wrong, f"wrong layouts: {wrong[:5]}"
    assert not missed, f"shards replicated that could be kept: {missed[:5]}"


def test_chunk_examples():
    # 5 rows x 3 cols over 4 ranks: rows [2,2,1,0] -> 6,6,3,0 elements, chunk(15, 4) = 4,4,4,3
    assert not dm.chunks_agree(5, 3, 1, 4)
    assert dm.chunks_agree(8, 6, 1, 4)
    assert dm.chunks_agree(7, 2, 1, 4)   # [2,2,2,1] rows -> [4,4,4,2] = chunk(14, 4): uneven but exact
    assert dm.chunks_agree(8, 1, 2, 4)   # (8,) -> (4, 2): 2 per rank = one row of 2
    assert not dm.chunks_agree(8, 1, 4, 4)  # (8,) -> (2, 4): 2 per rank is half a row


# ---------------------------------------------------------------- rank side

# name -> (global shape, fn on a tensor, never_communicates). never_communicates: the op
# keeps every shard by definition (permutations, unsqueeze, alias), whatever the layout.
CASES = {
    "view 8x6->48": ((8, 6), lambda x: x.view(48), False),
    "view 8x6->4x12": ((8, 6), lambda x: x.view(4, 12), False),
    "view 8x6->2x4x6": ((8, 6), lambda x: x.view(2, 4, 6), False),
    "view 6x8->6x4x2": ((6, 8), lambda x: x.view(6, 4, 2), False),
    "view 6x8->6x2x4": ((6, 8), lambda x: x.view(6, 2, 4), False),
    "view 5x3->15": ((5, 3), lambda x: x.view(15), False),
    "view 7x6->7x2x3": ((7, 6), lambda x: x.view(7, 2, 3), False),
    "view 7x2->14": ((7, 2), lambda x: x.view(-1), False),
    "view 4x6->3x8": ((4, 6), lambda x: x.view(3, 8), False),
    "view 4x6->8x3": ((4, 6), lambda x: x.view(8, 3), False),
    "view 4x1x6->4x6": ((4, 1, 6), lambda x: x.view(4, 6), False),
    "view 10->5x2": ((10,), lambda x: x.view(5, -1), False),
    "view 0x6->2x0x3": ((0, 6), lambda x: x.view(2, 0, 3), False),
    "reshape noncontig": ((4, 6), lambda x: x.t().reshape(24), False),
    "reshape 2x4x6->8x6": ((2, 4, 6), lambda x: x.reshape(8, 6), False),
    "flatten": ((2, 4, 6), lambda x: x.flatten(), False),
    "flatten 1": ((4, 2, 3), lambda x: x.flatten(1), False),
    "unflatten": ((4, 6), lambda x: x.unflatten(1, (2, 3)), False),
    "view_as": ((8, 6), lambda x: x.view_as(torch.empty(4, 12)), False),
    "squeeze": ((4, 1, 6), lambda x: x.squeeze(), False),
    "squeeze dim": ((4, 1, 6), lambda x: x.squeeze(1), False),
    "squeeze dims": ((4, 1, 6), lambda x: x.squeeze((0, 1)), False),
    "squeeze size1": ((1, 6), lambda x: x.squeeze(0), False),
    "squeeze no-op": ((4, 6), lambda x: x.squeeze(0), True),  # a shard may be size 1 locally only
    "squeeze all no-op": ((4, 6), lambda x: x.squeeze(), True),
    "unsqueeze 0": ((4, 6), lambda x: x.unsqueeze(0), True),
    "unsqueeze -1": ((5, 6), lambda x: x.unsqueeze(-1), True),
    "x[None]": ((4, 6), lambda x: x[None], True),
    "expand new": ((4, 6), lambda x: x.expand(3, 4, 6), False),
    "expand size1": ((4, 1), lambda x: x.expand(4, 6), False),
    "expand 1x6": ((1, 6), lambda x: x.expand(5, -1), False),
    "expand_as": ((6,), lambda x: x.expand_as(torch.empty(3, 6)), False),
    "permute": ((2, 3, 4), lambda x: x.permute(2, 0, 1), True),
    "transpose": ((4, 6), lambda x: x.transpose(0, 1), True),
    "transpose 3d": ((2, 3, 5), lambda x: x.transpose(0, 2), True),
    "t": ((4, 6), lambda x: x.t(), True),
    "t 1d": ((6,), lambda x: x.t(), True),
    "T": ((2, 3, 4), lambda x: x.T, True),
    "mT": ((2, 3, 4), lambda x: x.mT, True),
    "movedim": ((2, 3, 4), lambda x: x.movedim(0, 2), True),
    "swapaxes": ((2, 3, 4), lambda x: x.swapaxes(1, 2), True),
    "alias": ((4, 6), lambda x: aten.alias(x), True),
    "view dtype same size": ((4, 6), lambda x: x.view(torch.int64), False),
    "view dtype halves": ((4, 6), lambda x: x.view(torch.float32), False),  # last dim doubles
    "split 1": ((8, 6), lambda x: x.split(2, 1), False),
    "split 0 uneven": ((7, 6), lambda x: x.split(3, 0), False),
    "split whole": ((8, 6), lambda x: x.split(6, 1), False),
    "split_with_sizes": ((8, 6), lambda x: x.split([2, 4], 1), False),
    "chunk": ((8, 6), lambda x: x.chunk(3, 1), False),
    "tensor_split": ((8, 6), lambda x: x.tensor_split(3, 1), False),
    "unbind 0": ((4, 6), lambda x: x.unbind(0), False),
    "unbind 1": ((4, 3), lambda x: x.unbind(1), False),
    "narrow": ((8, 6), lambda x: x.narrow(1, 1, 3), False),
    "narrow whole": ((8, 6), lambda x: x.narrow(0, 0, 8), False),
    "select": ((8, 6), lambda x: x.select(1, 2), False),
    "x[1]": ((8, 6), lambda x: x[1], False),
    "x[..., -1]": ((8, 6), lambda x: x[..., -1], False),
    "slice": ((8, 6), lambda x: x[:, 1:4], False),
    "slice rows": ((8, 6), lambda x: x[2:6], False),
    "slice step": ((8, 6), lambda x: x[:, ::2], False),
    "slice all": ((5, 6), lambda x: x[:], False),
    "select_backward": ((4, 6), lambda g: aten.select_backward(g, [4, 3, 6], 1, 2), False),
    "slice_backward": ((4, 2, 6), lambda g: aten.slice_backward(g, [4, 5, 6], 1, 1, 5, 2), False),
}

# (case, mesh shape, input placements, expected placements of every output, communication?),
# derived by hand from the chunk arithmetic in the comments, not from running the rule:
EXPECT = [
    ("view 8x6->48", (4,), (S0,), (S0,), False),        # 2 rows = 12 elements = chunk(48, 4)
    ("view 8x6->48", (4,), (S1,), (R,), True),           # an inner dim cannot survive a flatten
    ("view 8x6->48", (2, 2), (S0, S0), (S0, S0), False),  # nested: 4 rows -> 2 rows, all even
    ("view 6x8->6x4x2", (4,), (S1,), (S1,), False),     # 2 columns = one row of the 4x2 split
    ("view 6x8->6x2x4", (4,), (S1,), (R,), True),        # 2 columns are half a row of 4
    ("view 6x8->6x2x4", (2, 2), (S1, R), (S1, R), False),  # over 2: 4 columns = one row of 4
    ("view 6x8->6x2x4", (2, 2), (S1, S1), (S1, R), True),   # the inner mesh dim needs half rows
    ("view 5x3->15", (4,), (S0,), (R,), True),           # rows [2,2,1,0] vs chunk(15, 4)
    ("view 7x2->14", (4,), (S0,), (S0,), False),        # rows [2,2,2,1] -> [4,4,4,2] = chunk(14, 4)
    ("view 4x6->3x8", (2, 2), (S0, R), (R, R), True),    # 2 rows of 6 = 12 elements = 1.5 rows of 8
    ("view 4x6->8x3", (2, 2), (S0, R), (S0, R), False),  # 12 elements = 4 rows of 3 = chunk(8, 2)
    ("view 4x1x6->4x6", (2, 2), (S2, S0), (S1, S0), False),
    ("view 10->5x2", (4,), (S0,), (R,), True),
    ("flatten", (2, 2), (S0, S1), (S0, R), True),
    ("unflatten", (4,), (S0,), (S0,), False),
    ("squeeze", (4,), (S2,), (S1,), False),
    ("squeeze size1", (4,), (S0,), (R,), True),
    ("unsqueeze 0", (2, 2), (S1, S0), (S2, S1), False),
    ("expand new", (4,), (S1,), (S2,), False),
    ("expand size1", (4,), (S0,), (S0,), False),
    ("expand size1", (4,), (S1,), (R,), True),
    ("expand size1", (4,), (P,), (P,), False),
    ("view dtype halves", (4,), (S0,), (S0,), False),
    ("view dtype halves", (4,), (S1,), (R,), True),
    ("view dtype same size", (2, 2), (S1, S0), (S1, S0), False),
    ("transpose", (2, 2), (S0, S1), (S1, S0), False),
    ("permute", (4,), (S2,), (S0,), False),
    ("movedim", (2, 2), (S0, S2), (S2, S1), False),
    ("split 1", (4,), (S1,), (R,), True),
    ("split 1", (2, 2), (S0, S1), (S0, R), True),
    ("split whole", (4,), (S1,), (S1,), False),
    ("unbind 0", (2, 2), (S1, S0), (S0, R), True),
    ("narrow", (2, 2), (S0, S1), (S0, R), True),
    ("narrow whole", (4,), (S0,), (S0,), False),
    ("select", (2, 2), (S0, S1), (S0, R), True),
    ("x[1]", (4,), (S1,), (S0,), False),
    ("slice", (4,), (P,), (P,), False),
    ("select_backward", (2, 2), (S0, S1), (S0, S2), False),
    ("slice_backward", (4,), (S1,), (R,), True),
    ("slice_backward", (4,), (S2,), (S2,), False),
]


def _layouts(ndim, mesh_ndim):
    opts = [R, P] + [Shard(d) for d in range(ndim)]
    return list(itertools.product(opts, repeat=mesh_ndim))


def _full(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _as_list(y):
    return list(y) if isinstance(y, (list, tuple)) else [y]


def _sweep(mesh_shape, names):
    """Every case under every layout: mismatches, and (case, in, outs, collectives) records."""
    from shardprop import distribute_tensor, init_device_mesh
    from shardprop.debug.explain import explain
    mesh = init_device_mesh("cpu", mesh_shape)
    problems, records = [], []
    for ci, name in enumerate(names):
        shape, fn, _ = CASES[name]
        full = _full(shape, ci)
        want = _as_list(fn(full))
        for pl in _layouts(len(shape), len(mesh_shape)):
            try:
                x = distribute_tensor(full, mesh, pl)
                with explain() as ex:
                    got = _as_list(fn(x))
                n_coll = sum(len(r.collectives) for r in ex.records)
                for j, (g, w) in enumerate(zip(got, want)):
                    if g.shape != w.shape or not torch.allclose(g.full_tensor(), w):
                        problems.append(f"{name} {pl}: output {j} differs")
                records.append((name, pl, tuple(tuple(g.placements) for g in got), n_coll))
            except Exception as e:  # collected, so one bad case does not hide the others
                problems.append(f"{name} {pl}: {type(e).__name__}: {e}")
    return problems, records


@pytest.fixture(scope="module", params=[(4,), (2, 2)], ids=["1d", "2x2"])
def sweep(request):
    per_rank = run_on_ranks(4, _sweep, request.param, list(CASES), timeout=300)
    return request.param, per_rank


def test_views_match_torch(sweep):
    mesh_shape, per_rank = sweep
    problems = [p for probs, _ in per_rank for p in probs]
    assert not problems, "\n".join(problems[:30])
    recs = per_rank[0][1]
    assert all(r == recs for _, r in per_rank), "ranks disagree on placements"
    assert len(recs) == sum(len(_layouts(len(CASES[n][0]), len(mesh_shape))) for n in CASES)


def test_shape_preserving_views_never_communicate(sweep):
    _, per_rank = sweep
    bad = [(n, pl, outs, c) for n, pl, outs, c in per_rank[0][1] if CASES[n][2] and c]
    assert not bad, f"permutation-like views that communicated: {bad[:10]}"


def test_partial_passes_through(sweep):
    _, per_rank = sweep
    for name, pl, outs, _ in per_rank[0][1]:
        if name.startswith("view dtype"):  # reinterpreting bits is not linear
            assert not any(p.is_partial() for o in outs for p in o), f"{name} {pl}: Partial kept: {outs}"
            continue
        for m, p in enumerate(pl):
            if p == P:
                assert all(o[m] == P for o in outs), f"{name} {pl}: Partial became {outs}"


def test_expected_layouts(sweep):
    mesh_shape, per_rank = sweep
    table = {(n, pl): (outs, c) for n, pl, outs, c in per_rank[0][1]}
    checked = 0
    for name, mesh, pl, want, comm in EXPECT:
        if mesh != mesh_shape:
            continue
        assert (name, pl) in table, f"{name} {pl} did not run: see test_views_match_torch"
        outs, n_coll = table[(name, pl)]
        assert all(o == want for o in outs), f"{name} {pl} on {mesh}: got {outs}, want {want}"
        assert (n_coll > 0) == comm, f"{name} {pl} on {mesh}: {n_coll} collectives, expected comm={comm}"
        checked += 1
    assert checked


# ---------------------------------------------------------------- backward, inference mode, in place

BACKWARD = {
    "view": ((8, 6), lambda x: x.view(4, 12)),
    "view flatten": ((8, 6), lambda x: x.view(48)),
    "reshape noncontig": ((4, 6), lambda x: x.t().reshape(24)),
    "transpose": ((4, 6), lambda x: x.transpose(0, 1)),
    "t": ((4, 6), lambda x: x.t()),
    "permute": ((2, 4, 6), lambda x: x.permute(2, 0, 1)),
    "expand": ((4, 1), lambda x: x.expand(4, 6)),  # backward: sum.dim_IntList(keepdim=True)
    "expand new": ((4, 6), lambda x: x.expand(3, 4, 6)),
    "unsqueeze": ((4, 6), lambda x: x.unsqueeze(1)),
    "squeeze": ((4, 1, 6), lambda x: x.squeeze(1)),
    "select": ((4, 6), lambda x: x.select(1, 2)),
    "slice": ((8, 6), lambda x: x[:, 1:5:2]),
    "narrow": ((8, 6), lambda x: x.narrow(0, 2, 4)),
}


def _backward(mesh_shape):
    from shardprop import distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape)
    problems = []
    for ci, (name, (shape, fn)) in enumerate(BACKWARD.items()):
        full = _full(shape, ci)
        ref = full.clone().requires_grad_(True)
        y_ref = fn(ref)
        w = _full(y_ref.shape, 100 + ci)
        (g_ref,) = torch.autograd.grad(y_ref, ref, w)
        for pl in itertools.product([R] + [Shard(d) for d in range(len(shape))], repeat=len(mesh_shape)):
            try:
                x = distribute_tensor(full, mesh, pl).requires_grad_(True)
                y = fn(x)
                wd = distribute_tensor(w, mesh, y.placements)
                (g,) = torch.autograd.grad(y, x, wd)  # only the view's backward runs
                if not torch.allclose(g.full_tensor(), g_ref):
                    problems.append(f"{name} {pl}: wrong gradient")
            except Exception as e:
                problems.append(f"{name} {pl}: {type(e).__name__}: {str(e)[:300]}")
    return problems


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d", "2x2"])
def test_backward_through_views(mesh_shape):
    problems = run_on_ranks(4, _backward, mesh_shape, timeout=300)[0]
    assert not problems, "\n".join(problems[:30])


INFERENCE = {  # composite ops that reach __torch_dispatch__ themselves under inference_mode
    "reshape": ((8, 6), lambda x: x.reshape(48)),
    "reshape noncontig": ((4, 6), lambda x: x.t().reshape(24)),
    "flatten": ((2, 4, 6), lambda x: x.flatten(0, 1)),
    "unflatten": ((4, 6), lambda x: x.unflatten(1, (2, 3))),
    "ravel": ((4, 6), lambda x: x.ravel()),
    "chunk": ((8, 6), lambda x: x.chunk(2, 0)),
    "narrow": ((8, 6), lambda x: x.narrow(1, 0, 2)),
    "movedim": ((2, 3, 4), lambda x: x.movedim(0, -1)),
    "swapaxes": ((2, 3, 4), lambda x: x.swapaxes(0, 1)),
    "mT": ((2, 3, 4), lambda x: x.mT),
    "T": ((2, 3, 4), lambda x: x.T),
    "expand_as": ((4, 1), lambda x: x.expand_as(x.expand(3, 4, 6))),  # other: a DTensor too
    "view_as": ((8, 6), lambda x: x.view_as(x.view(4, 12))),
    "reshape_as": ((4, 6), lambda x: x.t().reshape_as(x.view(24))),
    "broadcast_to": ((4, 1), lambda x: x.broadcast_to(3, 4, 6)),
    "tensor_split": ((8, 6), lambda x: x.tensor_split([1, 4], 1)),
    "hsplit": ((8, 6), lambda x: x.hsplit(2)),
    "vsplit": ((8, 6), lambda x: x.vsplit(2)),
    "atleast_3d": ((8, 6), lambda x: torch.atleast_3d(x)),
}


def _inference(mesh_shape):
    from shardprop import distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape)
    problems = []
    with torch.inference_mode():
        for ci, (name, (shape, fn)) in enumerate(INFERENCE.items()):
            full = _full(shape, ci)
            want = _as_list(fn(full))
            for pl in itertools.product([R] + [Shard(d) for d in range(len(shape))], repeat=len(mesh_shape)):
                try:
                    got = _as_list(fn(distribute_tensor(full, mesh, pl)))
                    if any(g.shape != w.shape or not torch.allclose(g.full_tensor(), w) for g, w in zip(got, want)):
                        problems.append(f"{name} {pl}: wrong result")
                except Exception as e:
                    problems.append(f"{name} {pl}: {type(e).__name__}: {str(e)[:300]}")
    return problems


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d", "2x2"])
def test_inference_mode_composites(mesh_shape):
    problems = run_on_ranks(4, _inference, mesh_shape, timeout=300)[0]
    assert not problems, "\n".join(problems[:30])


def _inplace():
    from shardprop import ShardingError, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2))
    full = _full((4, 6), 0)
    out = {}
    x = distribute_tensor(full, mesh, [S0, S1])
    local = x._local_tensor
    assert x.t_() is x
    out["t_"] = (tuple(x.shape), x.placements, x._local_tensor is local)
    torch.testing.assert_close(x.full_tensor(), full.t())
    x.transpose_(0, 1)
    out["transpose_"] = (tuple(x.shape), x.placements)
    torch.testing.assert_close(x.full_tensor(), full)
    x.unsqueeze_(1)
    out["unsqueeze_"] = (tuple(x.shape), x.placements)
    torch.testing.assert_close(x.full_tensor(), full.unsqueeze(1))
    x.squeeze_(1)
    out["squeeze_"] = (tuple(x.shape), x.placements)
    torch.testing.assert_close(x.full_tensor(), full)
    z = distribute_tensor(full, mesh, [S0, S0])  # 1 row per rank: squeeze_(0) must still be a no-op
    z.squeeze_(0)
    out["squeeze_ no-op"] = (tuple(z.shape), z.placements, tuple(z._local_tensor.shape))
    y = distribute_tensor(full[:1], mesh, [S0, R])  # a sharded size-1 dim cannot be squeezed in place
    try:
        y.squeeze_(0)
        out["squeeze_ sharded"] = "no error"
    except ShardingError:
        out["squeeze_ sharded"] = "ShardingError"
    return out


def test_inplace_views():
    out = run_on_ranks(4, _inplace)[0]
    assert out["t_"] == ((6, 4), (S1, S0), True)
    assert out["transpose_"] == ((4, 6), (S0, S1))
    assert out["unsqueeze_"] == ((4, 1, 6), (S0, S2))
    assert out["squeeze_"] == ((4, 6), (S0, S1))
    assert out["squeeze_ no-op"] == ((4, 6), (S0, S0), (1, 6))
    assert out["squeeze_ sharded"] == "ShardingError"


def _odd_strides():
    """A shard whose strides differ from the global ones (an uneven gather leaves a narrow
    of the padded buffer): view must still work."""
    from shardprop import distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (4,))
    full = _full((8, 6), 0)
    x = distribute_tensor(full, mesh, [S1]).redistribute(placements=[R])  # 6 cols over 4: [2,2,2,0]
    return [torch.equal(x.view(48).full_tensor(), full.view(48)),
            torch.equal(x.view(2, 4, 6).full_tensor(), full.view(2, 4, 6))]


def test_view_of_odd_strided_shard():
    assert run_on_ranks(4, _odd_strides) == [[True, True]] * 4
