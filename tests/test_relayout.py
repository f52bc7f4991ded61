"""shardprop.parallel.relayout: the direct even 1-d S(d) -> R and P -> S(d) equal the general planner and plain torch.

On 4 ranks: gather and reduce-scatter on dims 0, 1 and 2, with a leading size-1 dim (the pieces
already in order), uneven sizes (not covered: None, the planner's path), other transitions (None),
and the DTensor-level ``redistribute`` with its backward, against plain torch on full tensors.
"""
import torch
import torch.distributed as dist

from shardprop import DTensor, Partial, Replicate, Shard, comm_counter, init_device_mesh
from shardprop.tensor.dtensor import make_spec
from tests.rankpool import run_on_ranks


def _relayout_cases():
    from shardprop.parallel.relayout import redistribute, relayout
    from shardprop.tensor.redistribute import redistribute_local
    mesh = init_device_mesh("cpu", (4,))
    r = dist.get_rank()
    covered = 0
    for shape in [(8, 4, 3), (1, 8, 3), (2, 3, 8), (5, 6, 4)]:
        torch.manual_seed(0)
        full = torch.randn(shape)
        for d in range(3):
            # S(d) -> R: every rank's chunk of the same full tensor.
            spec = make_spec(mesh, (Shard(d),), shape, None, torch.float32)
            if shape[d] % 4 == 0:
                piece = full.chunk(4, d)[r].contiguous()
                got = relayout(piece, spec, (Replicate(),))
                assert got is not None, (shape, d)
                torch.testing.assert_close(got, full, rtol=0, atol=0)
                assert got.is_contiguous()
                torch.testing.assert_close(got, redistribute_local(piece, spec, (Replicate(),)), rtol=0, atol=0)
                covered += 1
            else:  # uneven: not covered (no collective issued, the caller plans)
                assert relayout(full.narrow(d, 0, 1), spec, (Replicate(),)) is None, ("uneven", shape, d)
            # P -> S(d): rank-dependent partial values summing to a known total.
            part = full * (r + 1)
            pspec = make_spec(mesh, (Partial(),), shape, None, torch.float32)
            got = relayout(part, pspec, (Shard(d),))
            if shape[d] % 4:
                assert got is None, ("uneven", shape, d)
                continue
            want = (full * 10).chunk(4, d)[r]
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(got, redistribute_local(part, pspec, (Shard(d),)))
            covered += 1
    # Not covered: S(0) -> S(1), R -> S(0), P(max) -> S(0).
    spec = make_spec(mesh, (Shard(0),), (8, 8), None, torch.float32)
    assert relayout(torch.ones(2, 8), spec, (Shard(1),)) is None
    assert relayout(torch.ones(8, 8), spec.with_placements((Replicate(),)), (Shard(0),)) is None
    assert relayout(torch.ones(8, 8), spec.with_placements((Partial("max"),)), (Shard(0),)) is None

    # DTensor level, with backward: S(1) -> R, then a loss whose gradient is Partial or Replicate.
    torch.manual_seed(1)
    full = torch.randn(2, 8, 4)
    g = torch.randn(2, 8, 4)
    for grad_kind in ("replicate", "partial"):
        x = DTensor.from_local(full.chunk(4, 1)[r].clone(), mesh, (Shard(1),)).requires_grad_()
        with comm_counter() as k:
            y = redistribute(x, (Replicate(),))
        assert y.placements == (Replicate(),) and k.counts["all_gather"][0] == 1
        torch.testing.assert_close(y.to_local(), full)
        if grad_kind == "replicate":
            (y * DTensor.from_local(g, mesh, (Replicate(),))).sum().backward()
            want = g.chunk(4, 1)[r]
        else:  # a Partial gradient: each rank contributes (r+1)/10 of it
            gp = DTensor.from_local(g * (r + 1) / 10, mesh, (Partial(),))
            y.backward(gp)
            want = g.chunk(4, 1)[r]
        assert x.grad.placements == (Shard(1),), x.grad.placements
        torch.testing.assert_close(x.grad.to_local(), want)
    return covered


def test_relayout_matches_planner_and_torch():
    assert run_on_ranks(4, _relayout_cases)[0] == 10  # the even (shape, dim) pairs, both directions
