"""Before a cross-mesh move sends any data, every rank of both meshes agrees that all of them can.

A move between meshes is point to point on the default group: a rank that raises before its
messages leave (a shard of the wrong shape, a different target on the other side) would leave
its peers waiting for them until the collective timeout. So each rank first reports to the
first rank of the two meshes (the leader) whether it can go ahead, with a digest of the move it
was asked for; the leader answers every rank with one verdict: go, or who failed and why. A
failure then raises on every rank of both meshes within one round trip, with the failing rank's
own message. Ranks in neither mesh take no part.

Cost: one small message to the leader and one back per rank (the leader handles one per rank of
the two meshes), before a move that is itself point to point.

Example:
    >>> agree((0, 1, 2, 3), "(8, 4) float32 [S(0)] -> [R]", None, torch.device("cpu"))  # doctest: +SKIP
"""
from __future__ import annotations

import zlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

_TAG = 0x7FFF0001  # far above the data messages' tags (their index in the move's plan)
_TEXT = 246  # bytes of message a record carries
_RECORD = 1 + 4 + 4 + 1 + _TEXT  # status, digest, failing rank, text length, text


class MoveAbandoned(RuntimeError):
    """A rank of a cross-mesh move could not take part; raised on every other rank of the move."""


def _record(status: int, digest: int, rank: int, text: str, device) -> torch.Tensor:
    body = text.encode("utf-8", errors="replace")[:_TEXT]
    head = [status] + list(digest.to_bytes(4, "little")) + list((rank + 1).to_bytes(4, "little")) + [len(body)]
    out = torch.zeros(_RECORD, dtype=torch.uint8)
    out[:len(head)] = torch.tensor(head, dtype=torch.uint8)
    if body:
        out[len(head):len(head) + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return out.to(device)


def _read(rec: torch.Tensor):
    b = bytes(rec.cpu().tolist())
    n = b[9]
    return b[0], int.from_bytes(b[1:5], "little"), int.from_bytes(b[5:9], "little") - 1, \
        b[10:10 + n].decode("utf-8", errors="replace")


def agree(ranks: Sequence[int], what: str, problem: Optional[BaseException], device) -> None:
    """Report ``problem`` (None: this rank can go ahead with the move ``what``) and learn everyone's.

    Returns when every rank in ``ranks`` can go ahead with the same move. Otherwise raises on
    every rank: the failing rank re-raises its own ``problem``; the others raise
    :class:`MoveAbandoned` naming it and its message, or naming the rank whose move differs.

    Example:
        >>> agree((0, 1, 2, 3), describe(spec, mesh_23, [Shard(0)]), None, torch.device("cpu"))  # doctest: +SKIP
    """
    me = dist.get_rank()
    ranks = sorted(set(ranks))
    if "gloo" in str(dist.get_backend()).lower():  # gloo carries host tensors: no device copies for a few bytes
        device = torch.device("cpu")
    leader = ranks[0]
    digest = zlib.crc32(what.encode())
    text = what if problem is None else f"{type(problem).__name__}: {problem}"
    mine = _record(0 if problem is None else 1, digest, me, text, device)
    if me == leader:
        others = [r for r in ranks if r != me]
        got = [torch.empty_like(mine) for _ in others]
        works = [dist.irecv(g, r, tag=_TAG) for g, r in zip(got, others)]
        for w in works:
            w.wait()
        verdict = _verdict(ranks, [mine] + got, what)
        sends = [dist.isend(verdict, r, tag=_TAG) for r in others]
        for w in sends:
            w.wait()
    else:
        verdict = torch.empty_like(mine)
        send = dist.isend(mine, leader, tag=_TAG)
        recv = dist.irecv(verdict, leader, tag=_TAG)
        send.wait()
        recv.wait()
    status, _, failed, message = _read(verdict)
    if status == 0:
        return
    if problem is not None:
        raise problem
    raise MoveAbandoned(f"redistribute to another mesh: abandoned on every rank of the move because rank {failed} "
                        f"could not take part: {message}")


def _verdict(ranks, records, what: str) -> torch.Tensor:
    """The leader's answer: go (status 0), or the first failing rank and its message (status 1)."""
    device = records[0].device
    read = [_read(r) for r in records]
    for status, _, rank, text in read:
        if status:
            return _record(1, 0, rank, text, device)
    _, want, leader, _ = read[0]
    for _, digest, rank, text in read[1:]:
        if digest != want:
            return _record(1, 0, rank, f"it was asked for {text}, but rank {leader} for {what}", device)
    return _record(0, 0, -1, "", device)
