"""Moves of strided pieces: ``collectives.all_to_all(views=...)`` and ``collectives.send_recv``.

Each rank's pieces are strided views (a transposed local tensor narrowed along one dim, received
into a narrow of another dim of the output), uneven with an empty piece; values are checked
against the same pieces cut with plain torch from every rank's input (rebuilt locally from a
seed), sync and async (AsyncTensor), with the direct path on and off (the backend's batch), and
``comm_counter`` sees the logical collective with the input's bytes.
"""
import pytest
import torch

from tests.rankpool import run_on_ranks

WORLD = 4
# Uneven cuts with an empty piece: sizes of the sent dim and of the received dim per rank.
SEND_CUTS = [3, 0, 2, 2]   # dim 2 of the (transposed) local, 7 in all
RECV_ROWS = [2, 1, 3, 1]   # dim 1 of the local: each rank's own share, 7 in all


def _local(rank):
    """Rank ``rank``'s input: (4, RECV_ROWS[rank], 7), a non-contiguous (transposed) tensor."""
    base = torch.arange(4 * 7 * RECV_ROWS[rank], dtype=torch.float32).view(7, RECV_ROWS[rank], 4) + 1000 * rank
    return base.permute(2, 1, 0)


def _cut(t, dim, sizes):
    out, o = [], 0
    for s in sizes:
        out.append(t.narrow(dim, o, s))
        o += s
    return out


def _all_to_all_body(async_op, direct_on):
    import torch.distributed as dist
    from shardprop import init_device_mesh
    from shardprop.mesh import collectives as C
    from shardprop.mesh.transport import direct_collectives as D
    from shardprop.mesh.async_tensor import AsyncTensor

    old = D.set_enabled(direct_on)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        me = dist.get_rank()
        local = _local(me)
        assert not local.is_contiguous()
        # Rank j receives dim-2 piece j of everyone; piece from rank r lands at dim-1 rows of r.
        out = torch.full((4, sum(RECV_ROWS), SEND_CUTS[me]), -1.0)
        if not C.views_usable(local, mesh, 0):
            return "unusable"
        ins = _cut(local, 2, SEND_CUTS)
        outs = _cut(out, 1, RECV_ROWS)
        with C.comm_counter() as c:
            res = C.all_to_all(local, mesh, 0, out=out, views=(outs, ins), async_op=async_op,
                               finish_shape=out.shape)
        assert (type(res) is AsyncTensor) == async_op
        got = res.wait() if async_op else res
        want = torch.cat([_cut(_local(r), 2, SEND_CUTS)[me] for r in range(WORLD)], dim=1)
        return torch.equal(got, want), c.counts, local.numel() * 4
    finally:
        D.set_enabled(old)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_all_to_all_strided_views(async_op):
    for rank, res in enumerate(run_on_ranks(WORLD, _all_to_all_body, async_op, True)):
        assert res != "unusable", "direct path not usable on a CPU group of 4"
        ok, counts, nbytes = res
        assert ok, f"rank {rank}: wrong pieces"
        assert counts == {"all_to_all": (1, nbytes)}, f"rank {rank}: counted {counts}"


def _send_recv_body(async_op, direct_on, dtype=torch.float32):
    """Ring shift: rank r sends a strided column block to r+1, keeps the rest, receives r-1's into a strided view."""
    import torch.distributed as dist
    from shardprop.mesh import collectives as C
    from shardprop.mesh.transport import direct_collectives as D
    from shardprop.mesh.async_tensor import AsyncTensor

    old = D.set_enabled(direct_on)
    try:
        me = dist.get_rank()

        def src(r):
            t = torch.arange(5 * 9, dtype=torch.float32).view(5, 9) + 100 * r
            if dtype.is_complex:
                t = torch.complex(t, -t)
            return t.t()  # (9, 5), strided

        x = src(me)
        out = torch.full((9, 5), -1.0, dtype=dtype)
        to, frm = (me + 1) % WORLD, (me - 1) % WORLD
        sends = [(x[:, 1:3], to, 3), (x[:0], to, 4)]              # strided block, and an empty piece
        recvs = [(out[:, 1:3], frm, 3), (out[:0], frm, 4)]
        keep = [(x[:, 0:1], out[:, 0:1]), (x[:, 3:], out[:, 3:])]
        with C.comm_counter() as c:
            res = C.send_recv(sends, recvs, None, out, async_op=async_op, keep=keep)
        assert (type(res) is AsyncTensor) == async_op
        got = res.wait() if async_op else res
        want = x.clone()
        want[:, 1:3] = src(frm)[:, 1:3]
        return torch.equal(got, want), c.counts
    finally:
        D.set_enabled(old)


@pytest.mark.parametrize("direct_on", [True, False], ids=["direct", "batch"])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_send_recv_strided_views(async_op, direct_on):
    for rank, (ok, counts) in enumerate(run_on_ranks(WORLD, _send_recv_body, async_op, direct_on)):
        assert ok, f"rank {rank}: wrong result"
        assert counts == {"send": (2, 9 * 2 * 4), "recv": (2, 9 * 2 * 4)}, f"rank {rank}: counted {counts}"


def test_send_recv_strided_complex():
    """Complex strided pieces arrive intact (values and counted bytes)."""
    for rank, (ok, counts) in enumerate(run_on_ranks(WORLD, _send_recv_body, False, True, torch.complex64)):
        assert ok, f"rank {rank}: wrong result"
        assert counts == {"send": (2, 9 * 2 * 8), "recv": (2, 9 * 2 * 8)}, f"rank {rank}: counted {counts}"
