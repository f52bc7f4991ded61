"""Direct collectives through shared memory between ranks of one host (``mesh/transport/shm_transport.py``).

4 gloo ranks on this host: the transport is set up when a mesh is built; collectives give plain
torch's values and their messages went through the rings (counted); a small ring wraps around
and fills up (many async collectives posted before any is waited on) and still delivers in
order; messages longer than half a ring stream through it in chunks (strided ones too); ranks that make different
calls get an error naming sizes, not garbage; nothing is left in ``/dev/shm``; the switch off
gives gloo's messages.
"""
import glob
import os
import re

import torch
import torch.distributed as dist

from tests.rankpool import run_on_ranks


def _rank_data(shape, rank, salt=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + rank))


def _reattach(**settings):
    """Change ``settings`` (config names) and set the transport up again (collective); returns the old values."""
    from shardprop.mesh import config
    from shardprop.mesh.transport import shm_transport
    old = {k: config.set(k, v) for k, v in settings.items()}
    shm_transport.detach()
    shm_transport.attach()
    return old


def _collectives_through_rings():
    from shardprop import init_device_mesh
    from shardprop.mesh import collectives as C
    from shardprop.mesh.transport import shm_transport
    mesh = init_device_mesh("cpu", (4,))
    t = shm_transport.active()
    assert t is not None and t.rank == dist.get_rank()
    before = t.messages_sent
    me = dist.get_rank()
    x = _rank_data((6, 5), me)
    full = torch.cat([_rank_data((6, 5), r) for r in range(4)])
    assert torch.equal(C.all_gather(x, mesh, (0,)), full)
    total = sum(_rank_data((8, 3), r, 1) for r in range(4))
    torch.testing.assert_close(C.reduce_scatter(_rank_data((8, 3), me, 1), mesh, (0,)), total.chunk(4)[me])
    torch.testing.assert_close(C.all_reduce(_rank_data((8, 3), me, 1), mesh, (0,)), total)
    sent = t.messages_sent - before
    assert sent == 9, sent  # three collectives, one message to each of 3 peers
    leftover = glob.glob(f"/dev/shm/shardprop-{os.getpid()}-*")
    return leftover


def test_collectives_go_through_shared_memory_and_leave_no_files():
    for leftover in run_on_ranks(4, _collectives_through_rings, timeout=60):
        assert leftover == []


def _big_all_reduce():
    """All-reduces over 1 MB go as reduce-scatter + all-gather through the rings (uneven chunks too)."""
    from shardprop import init_device_mesh
    from shardprop.mesh import collectives as C
    from shardprop.mesh.transport import shm_transport
    mesh = init_device_mesh("cpu", (4,))
    me, t = dist.get_rank(), shm_transport.active()
    datas = [_rank_data((300_001,), r, 5) for r in range(4)]
    before = t.messages_sent
    for op, want in (("sum", sum(datas)), ("avg", sum(datas) / 4), ("max", torch.stack(datas).amax(0))):
        torch.testing.assert_close(C.all_reduce(datas[me].clone(), mesh, (0,), op), want)
    mine = datas[me].clone()
    out = C.all_reduce(mine, mesh, (0,), "sum", inplace=True)
    torch.testing.assert_close(mine, sum(datas))
    return out.data_ptr() == mine.data_ptr() and t.messages_sent - before == 4 * 6


def test_big_all_reduces_go_in_two_phases_through_shared_memory():
    assert all(run_on_ranks(4, _big_all_reduce, timeout=60))


def _wrap_and_fill():
    """A 64 KB ring (32 KB chunks): many posted collectives wrap it and fill it up; big messages stream."""
    from shardprop import init_device_mesh
    from shardprop.mesh import collectives as C
    from shardprop.mesh.transport import shm_transport
    old = _reattach(shm_ring_mb=0.0625)
    try:
        mesh = init_device_mesh("cpu", (4,))
        t = shm_transport.active()
        assert t.max_message == 32 << 10
        me = dist.get_rank()
        checked = 0
        for round_ in range(3):
            pending, expect = [], []
            for k in range(12):  # 12 x up to 24 KB to each peer before anything is waited on
                rows = 1 + (k * 7 + round_ * 5) % 24
                x = _rank_data((rows, 256), me, 10 * round_ + k)
                pending.append(C.all_gather(x, mesh, (0,), async_op=True))
                expect.append(torch.cat([_rank_data((rows, 256), r, 10 * round_ + k) for r in range(4)]))
            for p, e in zip(reversed(pending), reversed(expect)):  # waited on in reverse order
                assert torch.equal(p.wait(), e)
                checked += 1
        # Pieces of 16 B to 80 KB in one call: the big ones stream through the ring in chunks.
        sizes = [4, 20480, 64, 8]
        x = torch.cat([torch.full((s,), float(10 * me + j)) for j, s in enumerate(sizes)])
        before = t.messages_sent
        out = C.all_to_all(x, mesh, (0,), output_split_sizes=[sizes[me]] * 4, input_split_sizes=sizes)
        assert torch.equal(out, torch.cat([torch.full((sizes[me],), float(10 * r + me)) for r in range(4)]))
        assert t.messages_sent - before == 3
        # Every rank streams 1 MB to each peer while taking theirs in (8 times the ring each).
        big = _rank_data((256, 1024), me, 99)
        assert torch.equal(C.all_gather(big, mesh, (0,)), torch.cat([_rank_data((256, 1024), r, 99) for r in range(4)]))
        # Strided pieces bigger than a chunk: packed before, staged after.
        x = _rank_data((64, 1024), me, 98)
        out = torch.full((64, 1024), -1.0)
        group, ranks = mesh.group_for((0,))
        from shardprop.mesh.transport import direct_collectives as direct
        direct.all_to_all_views(list(out.chunk(4, 1)), list(x.chunk(4, 1)), group, ranks).wait()
        assert torch.equal(out, torch.cat([_rank_data((64, 1024), r, 98).chunk(4, 1)[me] for r in range(4)], 1))
        return checked
    finally:
        _reattach(**old)


def test_a_small_ring_wraps_fills_and_delivers_in_order():
    assert run_on_ranks(4, _wrap_and_fill, timeout=120) == [36] * 4


def _strided_pieces():
    """All-to-all of column blocks (strided sends) into column blocks (strided receives)."""
    from shardprop import init_device_mesh
    from shardprop.mesh.transport import direct_collectives as direct
    mesh = init_device_mesh("cpu", (4,))
    group, ranks = mesh.group_for((0,))
    me = dist.get_rank()
    x = _rank_data((5, 8), me)
    out = torch.full((5, 8), -1.0)
    direct.all_to_all_views(list(out.chunk(4, 1)), list(x.chunk(4, 1)), group, ranks).wait()
    want = torch.cat([_rank_data((5, 8), r).chunk(4, 1)[me] for r in range(4)], 1)
    return torch.equal(out, want)


def test_strided_pieces_are_copied_straight_from_and_into_their_views():
    assert all(run_on_ranks(4, _strided_pieces, timeout=60))


def _different_calls():
    """Rank 1 sends 4 floats where rank 0 expects 8: rank 0 gets an error naming both sizes."""
    from shardprop import init_device_mesh
    from shardprop.mesh.transport import direct_collectives as direct
    init_device_mesh("cpu", (4,))
    me, msg = dist.get_rank(), "no error"
    try:
        if me == 0:
            direct.exchange_global([], [(torch.empty(8), 1, 0)], None).wait(5)
        elif me == 1:
            direct.exchange_global([(torch.ones(4), 0, 0)], [], None).wait()
    except RuntimeError as e:
        msg = str(e)
    _reattach()  # the ring from 1 to 0 holds an unread message: start afresh
    return msg


def test_different_calls_give_an_error_naming_the_sizes():
    msgs = run_on_ranks(4, _different_calls, timeout=60)
    assert re.search(r"rank 1 sent message #(\d+) of 16 bytes where rank 0 expected #\1 of 32 bytes", msgs[0]), msgs[0]
    assert msgs[0].startswith("shardprop: a collective sent as direct point-to-point messages did not complete")
    assert msgs[1:] == ["no error"] * 3


def _two_hosts():
    """Ranks 0-1 and 2-3 on "different hosts": rings within a host, gloo's messages across, in one call."""
    from unittest import mock
    from shardprop import init_device_mesh
    from shardprop.mesh import collectives as C
    from shardprop.mesh.transport import shm_transport
    me = dist.get_rank()
    with mock.patch.object(shm_transport, "_host_id", lambda: f"host{me // 2}"):
        _reattach()
    try:
        t = shm_transport.active()
        assert t.carries(me ^ 1) and not t.carries((me + 2) % 4)
        mesh = init_device_mesh("cpu", (4,))
        before = t.messages_sent
        x = _rank_data((5, 3), me)
        assert torch.equal(C.all_gather(x, mesh, (0,)), torch.cat([_rank_data((5, 3), r) for r in range(4)]))
        assert t.messages_sent - before == 1  # the same-host peer only
        for n in (7, 300_001):  # small (one round) and big (gloo's ring: the group is not all on one host)
            datas = [_rank_data((n,), r, 3) for r in range(4)]
            torch.testing.assert_close(C.all_reduce(datas[me], mesh, (0,)), sum(datas))
        m2 = init_device_mesh("cpu", (2, 2))  # dim 1 groups are one host each, dim 0 groups span both
        for d in (0, 1):
            group_ranks = m2.group_for((d,))[1]
            got = C.reduce_scatter(_rank_data((4, 2), me, 4), m2, (d,))
            want = sum(_rank_data((4, 2), r, 4) for r in group_ranks).chunk(2)[group_ranks.index(me)]
            torch.testing.assert_close(got, want)
        return True
    finally:
        _reattach()


def test_ranks_on_two_hosts_mix_rings_and_gloo_in_one_call():
    assert all(run_on_ranks(4, _two_hosts, timeout=60))


def _ring_sizes_differ():
    """Ranks given different ring sizes agree on one (the smallest) and still deliver."""
    from shardprop import init_device_mesh
    from shardprop.mesh import collectives as C
    from shardprop.mesh.transport import shm_transport
    me = dist.get_rank()
    old = _reattach(shm_ring_mb=0.0625 if me == 0 else 1)
    try:
        mesh = init_device_mesh("cpu", (4,))
        big = _rank_data((64, 512), me, 7)  # 128 KB: streamed in 32 KB chunks
        same = torch.equal(C.all_gather(big, mesh, (0,)), torch.cat([_rank_data((64, 512), r, 7) for r in range(4)]))
        return shm_transport.active().max_message, same
    finally:
        _reattach(**old)


def test_ranks_given_different_ring_sizes_agree_on_one():
    assert run_on_ranks(4, _ring_sizes_differ, timeout=60) == [(32 << 10, True)] * 4


def _switched_off():
    from shardprop import init_device_mesh
    from shardprop.mesh import collectives as C
    from shardprop.mesh.transport import shm_transport
    old = _reattach(shm_transport=False)
    try:
        off = shm_transport.active() is None
        mesh = init_device_mesh("cpu", (4,))
        me = dist.get_rank()
        same = torch.equal(C.all_gather(_rank_data((3,), me), mesh, (0,)),
                           torch.cat([_rank_data((3,), r) for r in range(4)]))
        return off and same
    finally:
        _reattach(**old)


def test_switched_off_the_messages_go_through_gloo():
    assert all(run_on_ranks(4, _switched_off, timeout=60))


def _dies_or_waits(rank, port, out_path):
    """Rank 1 exits once the mesh is built; rank 0 then waits for its piece of an all-gather."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      SHARDPROP_COLLECTIVE_TIMEOUT="120")
    import time
    from shardprop import init_device_mesh
    from shardprop.mesh import collectives as C
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    dist.barrier()
    if rank == 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        C.all_gather(torch.ones(3), mesh, (0,))
        msg = "completed"
    except RuntimeError as e:
        msg = str(e)
    with open(out_path, "w") as f:
        f.write(f"{time.monotonic() - t0:.1f}\n{msg}")
    os._exit(0)


def test_a_peer_that_exited_gives_an_error_at_once_not_after_the_timeout(tmp_path):
    import multiprocessing
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = tmp_path / "rank0.txt"
    procs = [ctx.Process(target=_dies_or_waits, args=(r, port, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
        if p.is_alive():
            p.kill()
    seconds, msg = out.read_text().split("\n", 1)
    assert "rank 1 (process " in msg and "exited while rank 0 waited on it" in msg, msg
    assert float(seconds) < 20, seconds  # the collective timeout is 120 s
