"""Point-to-point redistribution: each rank receives exactly the pieces of its new shard it lacks.

Some transitions move pieces between a few ranks only: ``[S(0), R] -> [R, S(0)]`` on 2x2 swaps
half the tensor between two ranks while the other two keep theirs; ``[S(0), S(1)] -> [S(1), S(0)]``
transposes blocks. The per-mesh-dim collectives would all-gather there (every rank receives,
and most of it is thrown away); one batch of ``isend``/``irecv`` of the overlaps
(:func:`shardprop.tensor.boxes.plan_transfers`) moves only what is needed. The planner
(``redistribute.py``) prices both and keeps the cheaper one.

Only placements without ``Partial`` qualify: a partial value cannot move between ranks.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from shardprop.mesh.transport import buffer_pool
from shardprop.mesh import collectives as C
from shardprop.mesh.async_tensor import wait_all
from shardprop.tensor.boxes import Box, narrow, numel, plan_transfers, relative, shard_box
from shardprop.tensor.placement import Partial

# Cost model of one batch (see redistribute.COST_FACTOR): bytes a rank moves, taken as the
# mean of the busiest rank and the average rank (ranks with nothing to do finish at once,
# which matters where ranks share links or cores; the busiest still bounds the time), plus
# one fixed latency per peer of the rank with the most peers.
P2P_FACTOR = 1.0

# Meshes of more ranks than this (16) are not priced point to point: the price needs every rank's
# box against every other's (boxes.plan_transfers is quadratic in the ranks: at 65,536 ranks it
# never finishes), and on such meshes one rank's messages to its many peers lose to the
# collectives anyway. Planning then costs the same at any size; below it nothing changes.
MAX_RANKS = 16


class P2PPrice(NamedTuple):
    """What one point-to-point redistribution moves: its price inputs and the result."""

    bytes: int          # the byte figure the price uses (busiest and average rank)
    max_bytes: int      # bytes the busiest rank sends or receives
    total_bytes: int    # bytes sent over all ranks
    max_peers: int      # most peers one rank sends to or receives from


def eligible(shape, cur, dst, mesh_size: Optional[int] = None) -> bool:
    """Whether a transition can go point to point: concrete sizes, no Partial on either side, a mesh of
    at most :data:`MAX_RANKS` ranks.

    Example:
        >>> from shardprop.tensor.placement import Replicate, Shard
        >>> eligible((4, 4), (Shard(0), Replicate()), (Replicate(), Shard(0)))
        True
    """
    if any(type(n) is not int for n in shape):  # symbolic sizes (torch.compile): the collectives trace
        return False
    if mesh_size is not None and mesh_size > MAX_RANKS:
        return False
    return not any(type(p) is Partial for p in tuple(cur) + tuple(dst))


@functools.lru_cache(maxsize=1024)
def p2p_price(shape: Tuple[int, ...], mesh, cur, dst, itemsize: int) -> Optional[P2PPrice]:
    """The price inputs of moving ``shape`` from ``cur`` to ``dst`` point to point (None: nothing moves).

    Example:
        >>> p2p_price((8, 8), mesh22, (Shard(0), Replicate()), (Replicate(), Shard(0)), 4)  # doctest: +SKIP
        P2PPrice(bytes=96, max_bytes=128, total_bytes=256, max_peers=1)
    """
    transfers = plan_transfers(shape, mesh, cur, mesh, dst)
    sent, recv, to, frm = {}, {}, {}, {}
    for t in transfers:
        if t.src == t.dst:
            continue
        n = numel(t.box) * itemsize
        sent[t.src] = sent.get(t.src, 0) + n
        recv[t.dst] = recv.get(t.dst, 0) + n
        to.setdefault(t.src, set()).add(t.dst)
        frm.setdefault(t.dst, set()).add(t.src)
    if not sent:
        return None
    ranks = mesh._flat
    per_rank = [max(sent.get(r, 0), recv.get(r, 0)) for r in ranks]
    busiest, mean = max(per_rank), sum(per_rank) / len(ranks)
    # Sends and receives overlap: latency counts the longer of a rank's two lists of peers.
    peers = max(len(p) for p in list(to.values()) + list(frm.values()))
    return P2PPrice(int((busiest + mean) / 2), busiest, sum(sent.values()), peers)


class _Program(NamedTuple):
    """This rank's part of a point-to-point redistribution."""

    out_shape: Tuple[int, ...]
    keep: Optional[Tuple[Box, Box]]          # (in local, in out) of the piece this rank keeps, if any
    whole: bool                              # the kept piece is all of ``out`` and all of ``local``
    sends: Tuple[Tuple[Box, int, int], ...]  # (box in local, peer, tag)
    recvs: Tuple[Tuple[Box, int, int], ...]  # (box in out, peer, tag)


@functools.lru_cache(maxsize=1024)
def _program(shape: Tuple[int, ...], mesh, cur, dst, me: int) -> _Program:
    mine_src = shard_box(shape, mesh.shape, mesh._coord, cur)
    mine_dst = shard_box(shape, mesh.shape, mesh._coord, dst)
    keep, sends, recvs = None, [], []
    for tag, t in enumerate(plan_transfers(shape, mesh, cur, mesh, dst)):
        if t.src == me and t.dst == me:
            keep = (relative(t.box, mine_src), relative(t.box, mine_dst))
        elif t.src == me:
            sends.append((relative(t.box, mine_src), t.dst, tag))
        elif t.dst == me:
            recvs.append((relative(t.box, mine_dst), t.src, tag))
    whole = keep is not None and keep[0][1] == mine_src[1] == mine_dst[1]
    return _Program(mine_dst[1], keep, whole, tuple(sends), tuple(recvs))


def run_p2p(local: torch.Tensor, spec, cur, dst, owned: bool, async_op: bool) -> torch.Tensor:
    """This rank's new shard after the point-to-point move from ``cur`` to ``dst`` placements.

    ``owned``: the caller hands ``local`` over (a temporary), so a shard that stays entirely on
    this rank is returned as is instead of copied.

    Example:
        >>> run_p2p(local, spec, (Shard(0), Replicate()), (Replicate(), Shard(0)), False, False)  # doctest: +SKIP
    """
    mesh = spec.mesh
    local = wait_all(local)
    prog = _program(tuple(spec.shape), mesh, tuple(cur), tuple(dst), dist.get_rank())
    sends = [(narrow(local, box), peer, tag) for box, peer, tag in prog.sends]
    keep = ()
    if prog.whole and owned and local.is_contiguous():
        out = local  # nothing arrives: the shard is the input, which nobody else holds
    else:
        out = buffer_pool.empty(prog.out_shape, local)
        if prog.keep is not None:  # copied while the messages travel (it writes no received piece)
            keep = ((narrow(local, prog.keep[0]), narrow(out, prog.keep[1])),)
    # Pieces are views (strided ones are packed before they are sent, or received in a buffer
    # and copied into place): collectives.send_recv does that per message.
    recvs = [(narrow(out, box), peer, tag) for box, peer, tag in prog.recvs]
    return C.send_recv(sends, recvs, C.p2p_group(mesh), out, async_op=async_op, finish_shape=prog.out_shape,
                       keep=keep)


def moved_bytes_per_rank(shape, mesh, cur, dst, itemsize: int):
    """``{global rank: (bytes sent, bytes received)}`` of the point-to-point move (for tests and benches).

    Example:
        >>> moved_bytes_per_rank((8,), mesh4, (Shard(0),), (Replicate(),), 4)  # doctest: +SKIP
        {0: (24, 24), 1: (24, 24), 2: (24, 24), 3: (24, 24)}
    """
    out = {r: [0, 0] for r in mesh._flat}
    for t in plan_transfers(tuple(shape), mesh, tuple(cur), mesh, tuple(dst)):
        if t.src != t.dst:
            n = numel(t.box) * itemsize
            out[t.src][0] += n
            out[t.dst][1] += n
    return {r: tuple(v) for r, v in out.items()}

