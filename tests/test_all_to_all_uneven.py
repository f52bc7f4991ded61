"""The uneven all-to-all (``mesh/uneven_all_to_all.py``) on 4 gloo ranks.

Random split sizes (zeros included) drawn from a seed every rank shares, so each rank can
build the reference from every rank's data; sync and async, with exchanged and with given
output splits, on the whole mesh and on each dim of a 2x2 mesh, through the direct CPU
transport, gloo's own all-to-all and the host-staged route. Gradients against autograd in one
process over all ranks' data. Bad arguments on one rank raise on every rank, quickly.
"""
import time

import pytest
import torch
import torch.distributed as dist

from tests.rankpool import run_on_ranks


def _sizes(n, seed, rows=6):
    """sizes[r][j]: rows rank r sends to rank j (about a third of them zero)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, rows, (n, n), generator=g)
    s[torch.rand(n, n, generator=g) < 0.3] = 0
    return s.tolist()


def _data(rows, r, seed, tail=(3, 2)):
    return torch.randn((rows,) + tail, generator=torch.Generator().manual_seed(seed * 100 + r))


def _groups():
    from shardprop import init_device_mesh
    m1 = init_device_mesh("cpu", (4,))
    m2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    return [(m1, 0), (m2, "a"), (m2, "b")]


def _values(direct_on, staged):
    from shardprop import comm_counter
    from shardprop.mesh import all_to_all_uneven
    from shardprop.mesh.transport import direct_collectives, staging
    from shardprop.mesh.collectives import resolve
    old = direct_collectives.set_enabled(direct_on)
    old_mode = staging.force("cuda" if staged else "")
    staging.stats.clear()
    checked = 0
    try:
        for mesh, dim in _groups():
            _, ranks, n = resolve(mesh, dim)
            me = ranks.index(dist.get_rank())
            for seed in range(3):
                sizes = _sizes(n, seed)
                data = [_data(sum(sizes[r]), r, seed) for r in range(n)]
                want = torch.cat([data[r].split(sizes[r])[me] for r in range(n)])
                for async_op in (False, True):
                    for given in (False, True):
                        out_splits = [sizes[r][me] for r in range(n)] if given else None
                        with comm_counter() as c:
                            got = all_to_all_uneven(data[me], mesh, dim, sizes[me], out_splits, async_op=async_op)
                            got = got.wait() if async_op else got
                        assert type(got) is torch.Tensor and torch.equal(got, want), (dim, seed, async_op, given)
                        # One collective for the rows, one more for the sizes when they are exchanged.
                        assert c.counts["all_to_all"][0] == (1 if given else 2), c.counts
                        checked += 1
        # Every rank sends nothing: an empty result of the right trailing shape.
        mesh, dim = _groups()[0]
        got = all_to_all_uneven(torch.empty(0, 5), mesh, dim, [0, 0, 0, 0])
        assert got.shape == (0, 5)
        # Splits as a tensor (as routing produces them).
        sizes = _sizes(4, 7)
        me = dist.get_rank()
        data = [_data(sum(sizes[r]), r, 7) for r in range(4)]
        got = all_to_all_uneven(data[me], mesh, dim, torch.tensor(sizes[me]))
        assert torch.equal(got, torch.cat([data[r].split(sizes[r])[me] for r in range(4)]))
        staged_calls = staging.stats.get("all_to_all", 0)
    finally:
        direct_collectives.set_enabled(old)
        staging.force(old_mode)
    return checked, staged_calls


@pytest.mark.parametrize("direct_on,staged", [(True, False), (False, False), (True, True)],
                         ids=["direct", "gloo", "staged"])
def test_uneven_all_to_all_matches_every_ranks_data(direct_on, staged):
    out = run_on_ranks(4, _values, direct_on, staged)
    assert [c for c, _ in out] == [3 * 3 * 4] * 4
    # The staged route really ran (CPU tensors forced onto the gloo/cuda routes), and only then.
    assert all((s > 0) == staged for _, s in out), out


def _grads():
    from shardprop import init_device_mesh
    from shardprop.mesh import all_to_all_uneven
    mesh = init_device_mesh("cpu", (4,))
    me, n = dist.get_rank(), 4
    sizes = _sizes(n, 11)
    # One process: every rank's input as a leaf, every rank's output built by hand, one loss.
    xs = [_data(sum(sizes[r]), r, 11).requires_grad_() for r in range(n)]
    ws = [_data(sum(sizes[s][r] for s in range(n)), r, 12) for r in range(n)]
    ys = [torch.cat([xs[s].split(sizes[s])[r] for s in range(n)]) for r in range(n)]
    sum((y * w).sum() for y, w in zip(ys, ws)).backward()
    # Distributed: this rank's piece of the same loss.
    x = _data(sum(sizes[me]), me, 11).requires_grad_()
    y = all_to_all_uneven(x, mesh, 0, sizes[me])
    (y * ws[me]).sum().backward()
    torch.testing.assert_close(x.grad, xs[me].grad, rtol=0, atol=0)
    assert x.grad.abs().sum() > 0 or sum(sizes[me]) == 0
    # Second use: the gradient of a composition (there and back) is the identity's.
    x2 = _data(sum(sizes[me]), me, 13).requires_grad_()
    there = all_to_all_uneven(x2, mesh, 0, sizes[me])
    back = all_to_all_uneven(there * 2, mesh, 0, [sizes[s][me] for s in range(n)], sizes[me])
    torch.testing.assert_close(back, x2 * 2)
    back.sum().backward()
    torch.testing.assert_close(x2.grad, torch.full_like(x2, 2.0))
    return True


def test_uneven_all_to_all_gradient_equals_one_process():
    assert run_on_ranks(4, _grads) == [True] * 4


def _bad(kind):
    from shardprop import init_device_mesh
    from shardprop.mesh import all_to_all_uneven
    mesh = init_device_mesh("cpu", (4,))
    me = dist.get_rank()
    x, splits = torch.ones(6, 3), [1, 2, 3, 0]
    if me == 2 and kind == "sum":
        splits = [1, 2, 2, 0]
    if me == 1 and kind == "count":
        splits = [1, 2, 3]
    if me == 3 and kind == "row":
        x = torch.ones(6, 4)
    t0 = time.monotonic()
    try:
        all_to_all_uneven(x, mesh, 0, splits)
    except ValueError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.parametrize("kind,says", [("sum", "rank 2 (split sizes that do not sum to its rows)"),
                                       ("count", "rank 1 (wrong number of split sizes)"),
                                       ("row", "ranks disagree on the size of a row")])
def test_bad_splits_raise_on_every_rank(kind, says):
    out = run_on_ranks(4, _bad, kind, timeout=30)
    for msg, took in out:
        assert msg is not None and says in msg, out
        assert took < 5, out
    # The pool is still usable (no rank left blocked in a collective).
    assert run_on_ranks(4, _grads) == [True] * 4


def _compiled():
    from torch._dynamo.backends.common import aot_autograd
    from shardprop import init_device_mesh
    from shardprop.mesh import all_to_all_uneven
    mesh = init_device_mesh("cpu", (4,))
    me = dist.get_rank()
    sizes = _sizes(4, 21)
    ins, outs = sizes[me], [sizes[r][me] for r in range(4)]
    targets = []

    def keep_graph(gm, example_inputs):  # forward and backward graphs, as AOTAutograd hands them over
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def f(x):
        return all_to_all_uneven(x * 2, mesh, 0, ins, outs) + 1

    x = _data(sum(ins), me, 21).requires_grad_()
    want = f(x)
    want.sum().backward()
    want_grad, x.grad = x.grad, None
    got = torch.compile(f, fullgraph=True, backend=aot_autograd(fw_compiler=keep_graph, bw_compiler=keep_graph))(x)
    got.sum().backward()
    assert torch.equal(got, want) and torch.equal(x.grad, want_grad)
    # The row move is in the graphs as the functional all-to-all, forward and backward.
    return sum("all_to_all_single" in t for t in targets)


def test_uneven_all_to_all_compiles_with_given_splits():
    assert run_on_ranks(4, _compiled, timeout=180) == [2] * 4
