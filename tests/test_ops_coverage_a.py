"""Along-dim ops (ops/along_dim.py), shape ops (ops/shape_ops.py) and replicate-only ops
(ops/replicated.py) on real DTensors: a 4-rank 1-d mesh (even and uneven shards) and a 2x2 mesh.

Every case runs the op on sharded inputs, compares ``full_tensor()`` with plain torch, and
checks the output placements where the rule must keep a shard without communication (a
rule that replicated everything would still be right, but fail these).
"""

import pytest
import torch

from shardprop import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from tests.rankpool import run_on_ranks

S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()


def _t(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _out(res):
    """The op's (first) tensor output."""
    return res[0] if isinstance(res, (tuple, list)) else res


# (name, fn, input shapes, input placements (1-d mesh), expected output placements or None)
ALONG_CASES = [
    ("cumsum dim 1 on S0", lambda x: torch.cumsum(x, 1), [(8, 6)], [S0], (S0,)),
    ("cumsum dim -1 uneven S0", lambda x: torch.cumsum(x, -1), [(7, 5)], [S0], (S0,)),
    ("cumsum of the sharded dim", lambda x: torch.cumsum(x, 0), [(8, 6)], [S0], None),
    ("cumprod dim 0 on S1", lambda x: torch.cumprod(x, 0), [(4, 8)], [S1], (S1,)),
    ("logcumsumexp", lambda x: torch.logcumsumexp(x, 2), [(4, 3, 5)], [S1], (S1,)),
    ("cummax values", lambda x: torch.cummax(x, 1).values, [(8, 6)], [S0], (S0,)),
    ("cummin indices", lambda x: torch.cummin(x, 1).indices, [(8, 6)], [S0], (S0,)),
    ("sort default dim", lambda x: torch.sort(x).values, [(8, 6)], [S0], (S0,)),
    ("sort indices stable descending", lambda x: torch.sort(x, dim=0, stable=True, descending=True).indices,
     [(6, 8)], [S1], (S1,)),
    ("argsort of the sharded dim", lambda x: torch.argsort(x, dim=0), [(8, 6)], [S0], None),
    ("topk", lambda x: torch.topk(x, 3, dim=-1).values, [(5, 6)], [S0], (S0,)),
    ("kthvalue drops dim 0", lambda x: torch.kthvalue(x, 2, dim=0).values, [(6, 8)], [S1], (S0,)),
    ("kthvalue keepdim", lambda x: torch.kthvalue(x, 2, dim=0, keepdim=True).values, [(6, 8)], [S1], (S1,)),
    ("median dim", lambda x: torch.median(x, dim=1).values, [(8, 5)], [S0], (S0,)),
    ("mode", lambda x: torch.mode(x.round(), dim=-1).values, [(8, 5)], [S0], (S0,)),
    ("flip other dim", lambda x: torch.flip(x, [1]), [(8, 6)], [S0], (S0,)),
    ("flip the sharded dim", lambda x: torch.flip(x, [-2]), [(8, 6)], [S0], None),
    ("roll with dims", lambda x: torch.roll(x, 2, 1), [(8, 6)], [S0], (S0,)),
    ("roll flattened", lambda x: torch.roll(x, 3), [(8, 6)], [S0], None),
    ("glu", lambda x: torch.nn.functional.glu(x, -1), [(8, 6)], [S0], (S0,)),
    ("renorm keeps its own dim", lambda x: torch.renorm(x, 2, 0, 1.0), [(8, 6)], [S0], (S0,)),
    ("renorm of another dim", lambda x: torch.renorm(x, 2, 1, 1.0), [(8, 6)], [S0], None),
    ("cumsum of a Partial", lambda x: torch.cumsum(x, 0), [(8, 6)], [Partial()], (Partial(),)),
]

SHAPE_CASES = [
    ("tril rows sharded", lambda x: torch.tril(x), [(8, 8)], [S0], (S0,)),
    ("tril cols uneven, diagonal -1", lambda x: torch.tril(x, -1), [(6, 7)], [S1], (S1,)),
    ("triu rows uneven, diagonal 2", lambda x: torch.triu(x, diagonal=2), [(7, 9)], [S0], (S0,)),
    ("triu batched", lambda x: torch.triu(x, 1), [(3, 5, 8)], [S2], (S2,)),
    ("tril_ in place", lambda x: x.clone().tril_(1), [(8, 8)], [S1], (S1,)),
    ("pad last dim", lambda x: torch.nn.functional.pad(x, (1, 2)), [(8, 6)], [S0], (S0,)),
    ("pad the sharded dim", lambda x: torch.nn.functional.pad(x, (0, 0, 1, 0)), [(8, 6)], [S0], None),
    ("reflection pad", lambda x: torch.nn.functional.pad(x, (2, 1), mode="reflect"), [(4, 3, 6)], [S0], (S0,)),
    ("replication pad 2d", lambda x: torch.nn.functional.pad(x, (1, 1, 2, 0), mode="replicate"),
     [(4, 3, 5, 6)], [S1], (S1,)),
    ("repeat count 1 on the shard", lambda x: x.repeat(2, 1, 3), [(8, 6)], [S0], (S1,)),
    ("repeat the sharded dim", lambda x: x.repeat(2, 1), [(8, 6)], [S0], None),
    ("diagonal", lambda x: torch.diagonal(x, 1, 1, 2), [(8, 5, 5)], [S0], (S0,)),
    ("diagonal negative dims", lambda x: torch.diagonal(x, 0, -1, 0), [(5, 8, 5)], [S1], (S0,)),
    ("diag_embed", lambda x: torch.diag_embed(x), [(8, 5)], [S0], (S0,)),
    ("rot90", lambda x: torch.rot90(x, 1, [1, 2]), [(8, 3, 4)], [S0], (S0,)),
    ("unfold", lambda x: x.unfold(1, 3, 2), [(8, 9)], [S0], (S0,)),
    ("select_scatter", lambda x, y: torch.select_scatter(x, y, 1, 2), [(8, 5, 4), (8, 4)], [S2, S1], (S2,)),
    ("slice_scatter", lambda x, y: torch.slice_scatter(x, y, 1, 0, 4), [(8, 6), (8, 4)], [S0, S0], (S0,)),
    ("diagonal_scatter", lambda x, y: torch.diagonal_scatter(x, y, 0, 1, 2), [(8, 4, 4), (8, 4)], [S0, S0],
     (S0,)),
    ("pixel_shuffle", lambda x: torch.nn.functional.pixel_shuffle(x, 2), [(4, 8, 3, 3)], [S0], (S0,)),
]

REPLICATED_CASES = [
    ("inv of matrix_exp", lambda x: torch.linalg.inv(torch.matrix_exp(x * 0.1)), [(8, 8)], [S0], (R,)),
    ("det", lambda x: torch.linalg.det(x), [(8, 8)], [S1], (R,)),
    ("nonzero", lambda x: torch.nonzero(x > 0), [(8, 6)], [S1], (R,)),
    ("masked_select", lambda x: torch.masked_select(x, x > 0), [(8, 6)], [S0], (R,)),
    ("unique", lambda x: torch.unique(x.round(), return_counts=True)[1], [(8, 6)], [S0], (R,)),
    ("fft", lambda x: torch.fft.rfft(x).abs(), [(8, 6)], [S0], (R,)),
]


def _run_cases(cases, mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    problems = []
    for name, fn, shapes, placements, want in cases:
        fulls = [_t(*s, seed=i) for i, s in enumerate(shapes)]
        if len(mesh_shape) == 2:  # the 1-d placement on mesh dim 0, then R (and a second shard below)
            placements = [(p, R) for p in placements]
        else:
            placements = [(p,) for p in placements]
        dts = []
        for f, p in zip(fulls, placements):
            if type(p[0]) is Partial:  # each rank of mesh dim 0 holds a share: their sum is the full tensor
                dts.append(DTensor.from_local(f / mesh.shape[0], mesh, list(p)))
            else:
                dts.append(distribute_tensor(f, mesh, list(p)))
        expected = _out(fn(*fulls))
        try:
            got = _out(fn(*dts))
            torch.testing.assert_close(got.full_tensor(), expected, rtol=1e-4, atol=1e-4)
        except Exception as e:  # noqa: BLE001 - collected and reported with the case's name
            problems.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if want is not None and len(mesh_shape) == 1 and tuple(got.placements) != want:
            problems.append(f"{name}: placements {tuple(got.placements)}, expected {want}")
    return problems


GROUPS = {"along": ALONG_CASES, "shape": SHAPE_CASES, "replicated": REPLICATED_CASES}


def _check_group(group, mesh_shape):
    return [f"{mesh_shape} {p}" for p in _run_cases(GROUPS[group], mesh_shape)]


def _tri_2d_mesh():
    """tril/triu with both matrix dims sharded on a 2x2 mesh, uneven."""
    mesh = init_device_mesh("cpu", (2, 2))
    problems = []
    for shape, k in [((5, 7), 0), ((5, 7), -2), ((6, 3), 1), ((2, 9), 4)]:
        full = _t(*shape)
        for placements in ([S0, S1], [S1, S0], [S0, S0], [S1, S1]):
            x = distribute_tensor(full, mesh, placements)
            for op in (torch.tril, torch.triu):
                got = op(x, k)
                try:
                    torch.testing.assert_close(got.full_tensor(), op(full, k))
                except AssertionError as e:
                    problems.append(f"{op.__name__} {shape} k={k} {placements}: {e}")
                if list(got.placements) != placements:
                    problems.append(f"{op.__name__} {shape} {placements}: moved to {got.placements}")
    return problems


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_sharded_ops_match_torch(group, mesh_shape):
    results = run_on_ranks(4, _check_group, group, mesh_shape)
    assert results[0] == [], "\n".join(results[0])


def test_tril_triu_both_matrix_dims_sharded():
    results = run_on_ranks(4, _tri_2d_mesh)
    assert results[0] == [], "\n".join(results[0])


def test_cumsum_backward_through_shards():
    results = run_on_ranks(4, _cumsum_backward)
    assert results[0] == [], "\n".join(results[0])


def _cumsum_backward():
    mesh = init_device_mesh("cpu", (4,))
    problems = []
    full = _t(8, 6)
    w = _t(8, 6, seed=3)
    for fn in (lambda x: torch.cumsum(x, 1), lambda x: torch.flip(x, [1]).cumsum(1), lambda x: torch.roll(x, 2, 1),
               lambda x: torch.sort(x, 1).values, lambda x: torch.tril(x)):
        ref = full.clone().requires_grad_()
        (fn(ref) * w).sum().backward()
        x = distribute_tensor(full, mesh, [S0]).requires_grad_()
        wd = distribute_tensor(w, mesh, [S0])
        (fn(x) * wd).sum().backward()
        try:
            torch.testing.assert_close(x.grad.full_tensor(), ref.grad)
        except AssertionError as e:
            problems.append(str(e))
    return problems
