"""CPU collectives as direct point-to-point messages (``mesh/transport/direct_collectives.py``).

On 4 gloo ranks, ``mesh.collectives``' all-gather, reduce-scatter (sum, avg, max, min),
small all-reduce (in place or not) and all-to-all (even, uneven and empty splits), sync and async, on the whole mesh and on each dim
of a 2x2 mesh (groups whose ranks do not start at 0), against plain torch on the full data.
While the direct path is on, gloo's own collectives for these three are replaced by functions
that raise, so a test passes only if the messages did the work; with it off, the same calls
give the same values through gloo.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist

from tests.rankpool import run_on_ranks


@contextlib.contextmanager
def _gloo_collectives_forbidden():
    """gloo's all-gather / reduce-scatter / all-to-all / all-reduce raise inside this block (this rank only)."""
    from shardprop.mesh import collectives as C

    def forbidden(*a, **k):
        raise AssertionError("the backend's collective ran although the direct path is on")
    saved = C._all_gather_flat, C._reduce_scatter_flat, dist.all_to_all_single, dist.all_reduce
    C._all_gather_flat = C._reduce_scatter_flat = dist.all_to_all_single = dist.all_reduce = forbidden
    try:
        yield
    finally:
        C._all_gather_flat, C._reduce_scatter_flat, dist.all_to_all_single, dist.all_reduce = saved


def _groups():
    """(mesh, dims, ranks of this rank's group in group order) for the 1-d mesh and both dims of a 2x2 mesh."""
    from shardprop import init_device_mesh
    out = [(init_device_mesh("cpu", (4,)), (0,))]
    m2 = init_device_mesh("cpu", (2, 2))
    out += [(m2, (0,)), (m2, (1,))]
    return [(m, d, m.group_for(d)[1]) for m, d in out]


def _rank_data(shape, rank, salt=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + rank))


def _check_all(direct_on: bool):
    from shardprop.mesh import collectives as C
    from shardprop.mesh.transport import direct_collectives as direct
    old = direct.set_enabled(direct_on)
    guard = _gloo_collectives_forbidden() if direct_on else contextlib.nullcontext()
    checked = 0
    try:
        with guard:
            for mesh, dims, ranks in _groups():
                n = len(ranks)
                me = ranks.index(dist.get_rank())
                for async_op in (False, True):
                    # all-gather: every rank's piece in group order along dim 0 (0-d and empty pieces too)
                    for shape in [(3, 5), (1,), (), (0, 4)]:
                        got = C.all_gather(_rank_data(shape, me), mesh, dims, async_op=async_op)
                        got = got.wait() if async_op else got
                        pieces = [_rank_data(shape, r) for r in range(n)]
                        want = torch.stack(pieces) if shape == () else torch.cat(pieces)
                        assert torch.equal(got, want), (dims, shape)
                        checked += 1
                    # reduce-scatter: this rank's dim-0 piece of the reduction over ranks
                    for op, fn in [("sum", lambda s: s.sum(0)), ("avg", lambda s: s.mean(0)),
                                   ("max", lambda s: s.amax(0)), ("min", lambda s: s.amin(0))]:
                        got = C.reduce_scatter(_rank_data((2 * n, 3), me, 1), mesh, dims, op, async_op=async_op)
                        got = got.wait() if async_op else got
                        full = fn(torch.stack([_rank_data((2 * n, 3), r, 1) for r in range(n)]))
                        torch.testing.assert_close(got, full.chunk(n)[me])
                        checked += 1
                    # all-reduce of a small tensor (direct: one round), into a new tensor or in place
                    for op, fn in [("sum", lambda s: s.sum(0)), ("avg", lambda s: s.mean(0)),
                                   ("max", lambda s: s.amax(0))]:
                        for inplace in (False, True):
                            mine = _rank_data((5, 3), me, 4)
                            kept = mine.clone()
                            got = C.all_reduce(mine, mesh, dims, op, async_op=async_op, inplace=inplace)
                            got = got.wait() if async_op else got
                            want = fn(torch.stack([_rank_data((5, 3), r, 4) for r in range(n)]))
                            torch.testing.assert_close(got, want)
                            # in place: the caller's tensor holds the result; else it is left alone
                            torch.testing.assert_close(mine, want if inplace else kept)
                            checked += 1
                    # all-to-all, even splits: dim-0 slice j goes to rank j
                    got = C.all_to_all(_rank_data((n * 2, 3), me, 2), mesh, dims, async_op=async_op)
                    got = got.wait() if async_op else got
                    want = torch.cat([_rank_data((n * 2, 3), r, 2).chunk(n)[me] for r in range(n)])
                    assert torch.equal(got, want)
                    # uneven splits, some empty: rank r sends (r + j) % 3 rows to rank j
                    sizes = [[(r + j) % 3 for j in range(n)] for r in range(n)]
                    data = [_rank_data((sum(sizes[r]), 2), r, 3) for r in range(n)]
                    got = C.all_to_all(data[me], mesh, dims, [sizes[r][me] for r in range(n)], sizes[me],
                                       async_op=async_op)
                    got = got.wait() if async_op else got
                    want = torch.cat([data[r].split(sizes[r])[me] for r in range(n)])
                    assert torch.equal(got, want)
                    checked += 2
    finally:
        direct.set_enabled(old)
    return checked


def _comm_counts_unchanged():
    """``comm_counter`` names the logical collective and its bytes whichever way it travels."""
    from shardprop.mesh import collectives as C
    from shardprop.mesh.transport import direct_collectives as direct
    from shardprop import comm_counter, init_device_mesh
    mesh = init_device_mesh("cpu", (4,))
    seen = []
    for on in (True, False):
        old = direct.set_enabled(on)
        try:
            with comm_counter() as k:
                C.all_reduce(torch.ones(2, 3), mesh, (0,))
                C.all_gather(torch.ones(2, 3), mesh, (0,))
                C.reduce_scatter(torch.ones(8, 3), mesh, (0,))
                C.all_to_all(torch.ones(8, 3), mesh, (0,))
            seen.append(dict(k.counts))
        finally:
            direct.set_enabled(old)
    assert seen[0] == seen[1] and set(seen[0]) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}, seen
    return True


@pytest.mark.parametrize("direct_on", [True, False], ids=["direct", "gloo"])
def test_collectives_match_plain_torch(direct_on):
    counts = run_on_ranks(4, _check_all, direct_on, timeout=120)
    assert counts[0] > 0 and len(set(counts)) == 1


def test_comm_counter_sees_direct_collectives():
    assert all(run_on_ranks(4, _comm_counts_unchanged, timeout=60))


def test_usable_only_for_eager_cpu_groups():
    from shardprop.mesh.transport import direct_collectives as direct
    assert direct.usable(torch.ones(3), 4)
    assert not direct.usable(torch.ones(3), 1)  # nothing to exchange
    assert not direct.usable(torch.ones(3), direct.MAX_GROUP + 1)  # n^2 messages: the backend's own
    assert not direct.usable(torch.ones(3, device="meta"), 4)
    old = direct.set_enabled(False)
    try:
        assert not direct.usable(torch.ones(3), 4)
    finally:
        direct.set_enabled(old)


def _one_rank_skips():
    """Rank 0 never joins; the others' direct all-gather must fail with shardprop's message, not hang."""
    from datetime import timedelta
    from shardprop import init_device_mesh
    from shardprop.mesh import collectives as C
    mesh = init_device_mesh("cpu", (4,))
    if dist.get_rank() == 0:
        return "skipped"
    pending = C.all_gather(torch.ones(4), mesh, (0,), async_op=True)
    try:
        pending._work.wait(timedelta(seconds=2))
    except RuntimeError as e:
        return str(e)
    return "completed"


def test_a_missing_rank_gives_an_error_not_a_hang():
    from tests.rankpool import get_pool
    try:
        out = run_on_ranks(4, _one_rank_skips, timeout=60)
    finally:
        get_pool(4).shutdown()  # messages to rank 0 are still posted: start the next test afresh
    assert out[0] == "skipped"
    for msg in out[1:]:
        assert msg.startswith("shardprop: a collective sent as direct point-to-point messages did not complete"), msg
        assert "SHARDPROP_DIRECT_COLLECTIVES=0" in msg



def test_errors_name_the_path_the_messages_took():
    from shardprop.mesh.transport import direct_collectives as direct

    class _Broken:
        def wait(self, timeout=None):
            raise RuntimeError("peer gone")
    msgs = []
    for on_direct in (True, False):
        with pytest.raises(RuntimeError) as e:
            direct.Works([_Broken()], direct=on_direct).wait()
        msgs.append(str(e.value))
    assert msgs[0].startswith("shardprop: a collective sent as direct point-to-point messages did not complete: peer gone")
    assert "SHARDPROP_DIRECT_COLLECTIVES=0" in msgs[0]
    assert msgs[1].startswith("shardprop: a batch of point-to-point messages did not complete: peer gone")
    assert "SHARDPROP_DIRECT_COLLECTIVES" not in msgs[1]
