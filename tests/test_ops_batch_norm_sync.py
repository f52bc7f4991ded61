"""Training batch norm on a batch-sharded DTensor: global statistics, as SyncBatchNorm (ops/batch_norm_sync.py).

Every check compares with one process running plain torch on the whole batch: the output, the
running mean and variance after the step, and the gradients of input, weight and bias.
"""
import pytest

from tests.rankpool import run_on_ranks


def _bn_case(shape, mesh_shape, placements_code, momentum, affine, steps, functional, stats_code=None):
    import torch
    import torch.nn.functional as F

    import shardprop as sp
    mesh = sp.init_device_mesh("cpu", mesh_shape)
    pl = [sp.Shard(int(c[1:])) if c.startswith("S") else sp.Replicate() for c in placements_code]
    g = torch.Generator().manual_seed(0)
    C = shape[1]
    x = torch.randn(shape, generator=g) * 3 + 1
    w = torch.randn(C, generator=g) if affine else None
    b = torch.randn(C, generator=g) if affine else None
    gout = torch.randn(shape, generator=g)
    rm, rv = torch.randn(C, generator=g), torch.rand(C, generator=g) + 0.5

    rep = [sp.Replicate()] * len(mesh_shape)
    dx = sp.distribute_tensor(x, mesh, pl).requires_grad_(True)
    dw = sp.distribute_tensor(w, mesh, rep).requires_grad_(True) if affine else None
    db = sp.distribute_tensor(b, mesh, rep).requires_grad_(True) if affine else None
    spl = rep if stats_code is None else [sp.Shard(0) if c == "S0" else sp.Replicate() for c in stats_code]
    drm, drv = sp.distribute_tensor(rm.clone(), mesh, spl), sp.distribute_tensor(rv.clone(), mesh, spl)
    xr = x.clone().requires_grad_(True)
    wr = w.clone().requires_grad_(True) if affine else None
    br = b.clone().requires_grad_(True) if affine else None
    rmr, rvr = rm.clone(), rv.clone()

    for _ in range(steps):
        if functional:
            out = F.batch_norm(dx, drm, drv, dw, db, training=True, momentum=momentum, eps=1e-5)
        else:
            out, _, _ = torch.ops.aten.native_batch_norm(dx, dw, db, drm, drv, True, momentum, 1e-5)
    for _ in range(steps):
        if functional:
            ref = F.batch_norm(xr, rmr, rvr, wr, br, training=True, momentum=momentum, eps=1e-5)
        else:
            ref, _, _ = torch.ops.aten.native_batch_norm(xr, wr, br, rmr, rvr, True, momentum, 1e-5)
    placements_out = tuple(out.placements)
    torch.testing.assert_close(out.full_tensor(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(drm.full_tensor(), rmr, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(drv.full_tensor(), rvr, rtol=1e-5, atol=1e-6)
    out.backward(sp.distribute_tensor(gout, mesh, out.placements))
    ref.backward(gout)
    torch.testing.assert_close(dx.grad.full_tensor(), xr.grad, rtol=1e-4, atol=1e-5)
    if affine:
        torch.testing.assert_close(dw.grad.full_tensor(), wr.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(db.grad.full_tensor(), br.grad, rtol=1e-4, atol=1e-5)
    return placements_out == tuple(pl)


@pytest.mark.parametrize("shape,placements,functional", [
    ((8, 3, 5), ("S0",), True),          # even batch shard, F.batch_norm (running stats updated)
    ((10, 3, 4, 2), ("S0",), True),      # uneven batch shard (3, 3, 2, 2 rows), 4-d
    ((6, 4), ("S0",), False),            # 2-d input, aten.native_batch_norm, uneven
    ((4, 3, 9), ("S2",), True),          # a spatial shard is a batch shard too (uneven)
])
def test_batch_norm_training_global_statistics(shape, placements, functional):
    res = run_on_ranks(4, _bn_case, shape, (4,), placements, 0.1, True, 2, functional)
    # The output keeps the input's shard: the statistics moved, not the batch.
    assert res == [True] * 4


def test_batch_norm_training_2d_mesh_no_affine():
    # batch shard on one mesh dim, channel shard on the other (gathered first): output [S(0), R]
    res = run_on_ranks(4, _bn_case, (8, 4, 3), (2, 2), ("S0", "S1"), 0.3, False, 1, True)
    assert res == [False] * 4


def test_batch_norm_training_sharded_running_stats():
    # Running statistics sharded (uneven: 5 channels over 4 ranks) beside a replicated input: no
    # strategy of the rule keeps them in place, so the statistics are computed here and written back.
    res = run_on_ranks(4, _bn_case, (6, 5, 3), (4,), ("R",), 0.2, True, 2, True, ("S0",))
    assert res == [True] * 4


def _bn_comm(shape):
    import torch
    import torch.nn.functional as F

    import shardprop as sp
    from shardprop.mesh.collectives import comm_counter

    mesh = sp.init_device_mesh("cpu", (4,))
    x = sp.distribute_tensor(torch.randn(shape), mesh, [sp.Shard(0)])
    rm = sp.distribute_tensor(torch.zeros(shape[1]), mesh, [sp.Replicate()])
    rv = sp.distribute_tensor(torch.ones(shape[1]), mesh, [sp.Replicate()])
    with comm_counter() as cc:
        out = F.batch_norm(x, rm, rv, training=True)
    return str(cc), out._local_tensor.shape[0]


def test_batch_norm_training_moves_statistics_not_the_batch():
    res = run_on_ranks(4, _bn_comm, (64, 3, 5))
    text, rows = res[0]
    assert rows == 16  # the batch stayed sharded
    assert "all_gather" not in text, text  # no gathering of the input: only the per-channel sums
    assert "all_reduce" in text, text
