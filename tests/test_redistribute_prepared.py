"""The planner's prepared programs on the tensor-parallel hot path (what ``parallel/relayout.py`` did by hand).

``redistribute_local`` remembers the prepared program per (source spec, target placements) and a
repeated call runs it after one lookup; ``DTensor.redistribute`` runs the plan's prepared program.
On 4 gloo ranks, each transition twice (the first call prepares, the second takes the prepared
program) against plain torch on the full tensor, with ``comm_counter`` counting one collective per
call: sequence gathers ``S(d) -> R`` and reduce-scatters ``P -> S(d)`` on dims 0, 1 and 2, even
and uneven, with a leading size-1 dim; async results; a 2x2 mesh; and the DTensor level with its
backward (Replicate and Partial gradients).
"""
import torch
import torch.distributed as dist

from tests.rankpool import run_on_ranks


def _piece(full, mesh_shape, coord, placements):
    """This coordinate's shard cut with torch.chunk, outermost mesh dim first (no shardprop involved)."""
    from shardprop import Shard
    out = full
    for m, p in enumerate(placements):
        if type(p) is Shard:
            pieces = torch.chunk(out, mesh_shape[m], dim=p.dim)
            out = pieces[coord[m]] if coord[m] < len(pieces) else out.narrow(p.dim, out.shape[p.dim], 0)
    return out.contiguous()


def _twice(fn, kind):
    """``fn()`` twice (prepare, then the prepared program), each issuing exactly one ``kind`` collective."""
    from shardprop import comm_counter
    outs = []
    for _ in range(2):
        with comm_counter() as k:
            outs.append(fn())
        assert dict(k.counts).keys() == {kind} and k.counts[kind][0] == 1, dict(k.counts)
    return outs


def _sequence_cases():
    from shardprop import Partial, Replicate, Shard, init_device_mesh
    from shardprop.tensor import redistribute as rd
    from shardprop.tensor.dtensor import make_spec
    mesh = init_device_mesh("cpu", (4,))
    r = dist.get_rank()
    checked = 0
    for shape in [(8, 4, 3), (1, 8, 3), (2, 3, 8), (5, 6, 4)]:
        full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        for d in range(3):
            # S(d) -> R: every rank's chunk of the same full tensor (uneven ones too).
            spec = make_spec(mesh, (Shard(d),), shape, None, torch.float32)
            piece = _piece(full, (4,), (r,), (Shard(d),))
            for got in _twice(lambda: rd.redistribute_local(piece, spec, (Replicate(),)), "all_gather"):
                torch.testing.assert_close(got, full, rtol=0, atol=0)
                assert got.is_contiguous()
            assert (spec, (Replicate(),)) in rd._READY
            # P -> S(d): rank-dependent partial values summing to 10 * full.
            part = full * (r + 1)
            pspec = make_spec(mesh, (Partial(),), shape, None, torch.float32)
            want = _piece(full * 10, (4,), (r,), (Shard(d),))
            for got in _twice(lambda: rd.redistribute_local(part, pspec, [Shard(d)]), "reduce_scatter"):
                torch.testing.assert_close(got, want)
                assert got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(part, full * (r + 1), rtol=0, atol=0)  # the input is left alone
            # Async: the prepared program's result waits on first use.
            got = rd.redistribute_local(part, pspec, (Shard(d),), async_op=True)
            torch.testing.assert_close(got + 0, want)
            checked += 1
    return checked


def test_prepared_sequence_gathers_and_reduce_scatters():
    assert run_on_ranks(4, _sequence_cases) == [12] * 4


def _mesh_2x2_cases():
    from shardprop import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
    from shardprop.tensor import redistribute as rd
    mesh = init_device_mesh("cpu", (2, 2))
    coord = mesh.get_coordinate()
    full = torch.randn(6, 5, generator=torch.Generator().manual_seed(3))
    for src, dst in [((Shard(0), Shard(1)), (Replicate(), Replicate())),
                     ((Shard(0), Shard(0)), (Replicate(), Replicate())),
                     ((Shard(1), Replicate()), (Replicate(), Shard(0)))]:
        x = distribute_tensor(full, mesh, src)
        for _ in range(2):
            got = rd.redistribute_local(x._local_tensor, x._spec, dst)
            torch.testing.assert_close(got, _piece(full, (2, 2), coord, dst), rtol=0, atol=0)
    # Partial on mesh dim 0 (the two ranks of each column group sum to 3 * full), reduce-scattered
    # there while mesh dim 1 keeps its shard.
    from shardprop import DTensor
    local = _piece(full, (2, 2), coord, (Replicate(), Shard(1))) * (coord[0] + 1)
    x = DTensor.from_local(local, mesh, (Partial(), Shard(1)), shape=full.shape)
    for dst in [(Shard(0), Shard(1)), (Replicate(), Shard(1))]:
        for _ in range(2):
            got = rd.redistribute_local(x._local_tensor, x._spec, dst)
            torch.testing.assert_close(got, _piece(full * 3, (2, 2), coord, dst))
    return True


def test_prepared_on_a_2x2_mesh():
    assert run_on_ranks(4, _mesh_2x2_cases) == [True] * 4


def _dtensor_cases():
    from shardprop import DTensor, Partial, Replicate, Shard, comm_counter, init_device_mesh
    mesh = init_device_mesh("cpu", (4,))
    r = dist.get_rank()
    full = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(1))
    g = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(2))
    for grad_kind in ("replicate", "partial", "replicate", "partial"):  # twice each: prepared the second time
        x = DTensor.from_local(full.chunk(4, 1)[r].clone(), mesh, (Shard(1),)).requires_grad_()
        with comm_counter() as k:
            y = x.redistribute(placements=(Replicate(),))
        assert y.placements == (Replicate(),) and dict(k.counts).keys() == {"all_gather"}
        assert k.counts["all_gather"][0] == 1
        torch.testing.assert_close(y.to_local(), full, rtol=0, atol=0)
        with comm_counter() as k:
            if grad_kind == "replicate":  # backward: this rank's chunk, no communication
                (y * DTensor.from_local(g, mesh, (Replicate(),))).sum().backward()
            else:  # a Partial gradient (each rank contributes (r+1)/10 of it): one reduce-scatter
                y.backward(DTensor.from_local(g * (r + 1) / 10, mesh, (Partial(),)))
        assert dict(k.counts).keys() == ({"reduce_scatter"} if grad_kind == "partial" else set()), dict(k.counts)
        assert x.grad.placements == (Shard(1),), x.grad.placements
        torch.testing.assert_close(x.grad.to_local(), g.chunk(4, 1)[r])
    # Without autograd: the same values, one all-gather.
    with torch.no_grad(), comm_counter() as k:
        y = x.redistribute(placements=[Replicate()])
    torch.testing.assert_close(y.to_local(), full, rtol=0, atol=0)
    assert k.counts["all_gather"][0] == 1
    return True


def test_dtensor_redistribute_and_backward_on_prepared_programs():
    assert run_on_ranks(4, _dtensor_cases) == [True] * 4
