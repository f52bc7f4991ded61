"""All-gather, reduce-scatter and all-to-all on CPU groups, as one batch of point-to-point messages.

Why: gloo's own collectives copy through temporaries. Its all-gather flattens into a fresh
buffer of the whole output and copies out of it; a fresh buffer page-faults on every call
on CPU, where nothing caches freed memory. Measured on this project's machine (4 gloo ranks on
127.0.0.1, a barrier before each call, medians):

    all-gather of 16 KB / 1 MB / 16 MB / 64 MB: gloo 4.7 / 5.7 / 26 / 223 ms,
    every rank sending its piece to each peer and receiving theirs straight into
    the output (this module): 3.6 / 3.6 / 23 / 79 ms.

So on a CPU group each rank sends its piece(s) directly to every peer and receives the peers'
pieces directly where they belong (the output, or for a reduction one stacked buffer that a
single ``torch.sum`` reduces). Nothing is flattened or copied by the transport. All-reduce
keeps gloo's (ring, in place) except for small tensors, where one round of direct messages
beats the ring's 2(n-1) steps (:func:`small_all_reduce`). Groups of more than
:data:`MAX_GROUP` ranks keep the backend's collectives too (direct messages grow as n²).

The functions take the output already allocated and return the pending work (wait on it),
so ``collectives.py`` keeps allocation, counting and async handling in one place. Every one
of them posts through :func:`exchange`.
Set ``SHARDPROP_DIRECT_COLLECTIVES=0`` (or call :func:`set_enabled`) to use the backend's
collectives everywhere.

Example:
    >>> if usable(t, n): work = all_gather(out, t, group, ranks)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from shardprop.mesh.transport import buffer_pool, shm_transport
from shardprop.mesh import config
from shardprop.mesh.config import values as _settings

MAX_GROUP = 16
# One tag for every message of these collectives: messages between two ranks with one tag are
# matched in the order they were posted, and every rank posts its collectives in program order.
TAG = 0x5D1C
# Direct all-reduce up to this many bytes sent per rank ((n - 1) x the tensor): 768 KB is 256 KB on 4 ranks.
SMALL_ALL_REDUCE_BYTES = 768 << 10
# ... and up to this tensor size when every rank of the group is reached through shared memory.
SHM_ALL_REDUCE_BYTES = 1 << 20
_REDUCE = {"sum": torch.sum, "avg": torch.sum, "max": torch.amax, "min": torch.amin, "product": torch.prod}



def set_enabled(on: bool) -> bool:
    """Turn the direct path on or off (for comparisons); returns the previous setting.

    Example:
        >>> old = set_enabled(False); set_enabled(old)
        False
    """
    return config.set("direct_collectives", on)


def usable(t: torch.Tensor, n: int) -> bool:
    """Whether a collective of ``t`` over ``n`` ranks goes point to point (eager CPU tensors, small groups).

    Example:
        >>> usable(torch.ones(4), 1)
        False
    """
    return _settings.direct_collectives and 1 < n <= MAX_GROUP and buffer_pool.plain(t)


class Works:
    """The messages of one collective, waited on as one.

    ``direct=False`` for messages the backend batches itself (``batch_isend_irecv``): an error
    then does not point at this module's path.
    """

    __slots__ = ("_works", "_direct")

    def __init__(self, works, direct: bool = True) -> None:
        self._works, self._direct = works, direct

    def wait(self, timeout=None) -> bool:
        try:
            for w in self._works:
                w.wait() if timeout is None else w.wait(timeout)
        except RuntimeError as e:
            raise _failed(e, self._direct) from e
        return True


def _failed(e: Exception, direct: bool = True) -> RuntimeError:
    """The backend's error (a timeout, a peer gone) saying which path it came from and what to check."""
    what = "a collective sent as direct point-to-point messages" if direct else "a batch of point-to-point messages"
    switch = "; SHARDPROP_DIRECT_COLLECTIVES=0 uses the backend's own collectives." if direct else "."
    return RuntimeError(f"shardprop: {what} did not complete: {e}\n"
                        "Every rank of the group must make the same collective calls in the same order "
                        f"(a timeout usually means one rank failed or took another path){switch}")


# (group, ranks) -> (this rank's index in ranks, each index's rank within the group): the group's own
# numbering, translated once (a mesh lists each dim's ranks ascending, so today these are equal).
_layout: dict = {}


def _group_layout(group, ranks: Sequence[int]) -> tuple:
    key = (group, tuple(ranks))
    hit = _layout.get(key)
    if hit is None:
        if len(_layout) > 1024:
            _layout.clear()
        hit = _layout[key] = (ranks.index(dist.get_rank()),
                              tuple(dist.get_group_rank(group, r) for r in ranks))
    return hit


def _wire(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _exchange(pieces_out: Sequence[torch.Tensor], pieces_in: Sequence[torch.Tensor], group, ranks) -> "Pending":
    """Send ``pieces_in[j]`` to rank j and receive rank j's into ``pieces_out[j]``; one's own piece is copied.

    Peers are visited in a ring order starting at one's neighbour, so that the ranks do not all
    send to the same rank first. Pieces may be strided views (see :func:`exchange`).
    """
    n = len(ranks)
    me, peer = _group_layout(group, ranks)
    shm = shm_transport.active()
    if shm is not None:
        glob = _covered(group, shm)
        if glob is not None:  # hot path: every peer through the rings, nothing for gloo
            handles = [(shm.recv(glob[peer[j]], pieces_out[j]), None, None)
                       for j in ((me - k) % n for k in range(1, n)) if pieces_out[j].numel()]
            for j in ((me + k) % n for k in range(1, n)):
                if pieces_in[j].numel():
                    shm.send(glob[peer[j]], pieces_in[j])
            shm.flush()
            pieces_out[me].copy_(pieces_in[me])
            return Pending(handles, ())
    sends = [(pieces_in[(me + k) % n], peer[(me + k) % n], TAG) for k in range(1, n)]
    recvs = [(pieces_out[(me - k) % n], peer[(me - k) % n], TAG) for k in range(1, n)]
    return exchange(sends, recvs, group, ((pieces_in[me], pieces_out[me]),))


def all_gather(out: torch.Tensor, t: torch.Tensor, group, ranks: Sequence[int]) -> Works:
    """Every rank's ``t`` (contiguous, equal shapes) into dim-0 slot of ``out`` by rank order.

    Example:
        >>> works = all_gather(torch.empty(8, 3), torch.ones(2, 3), group, [0, 1, 2, 3]); works.wait()  # doctest: +SKIP
    """
    n = len(ranks)
    slots = out.view((n,) + tuple(t.shape))
    return _exchange(slots, [t] * n, group, ranks)


def reduce_scatter_into(t: torch.Tensor, group, ranks: Sequence[int]) -> tuple:
    """Post a reduce-scatter of ``t`` (contiguous, dim 0 in ``n`` equal pieces).

    Returns ``(works, stacked)``: once the works are done, row ``j`` of ``stacked`` holds rank
    ``j``'s piece for this rank, and :func:`reduce` gives the result.

    Example:
        >>> works, stacked = reduce_scatter_into(torch.ones(8, 3), group, ranks)  # doctest: +SKIP
    """
    n = len(ranks)
    pieces = t.view((n, t.shape[0] // n) + tuple(t.shape[1:]))
    stacked = buffer_pool.empty(pieces.shape, t)
    return _exchange(stacked, pieces, group, ranks), stacked


def small_all_reduce(t: torch.Tensor, n: int, op: str, group=None) -> bool:
    """Whether an all-reduce of ``t`` over ``n`` ranks is cheaper direct (latency-bound sizes).

    A direct all-reduce sends the whole tensor to every peer ((n-1) times its bytes, against
    about twice for gloo's ring) in one round instead of the ring's 2(n-1) steps: measured on
    4 ranks through gloo's messages it is 1.3-2x faster up to 256 KB and slower from 1 MB;
    through shared memory (every rank of ``group`` on one host) 1.4-3.5x faster up to 1 MB
    and even at 2 MB.

    Example:
        >>> small_all_reduce(torch.ones(4), 4, "sum")
        True
    """
    if op not in _REDUCE:
        return False
    nbytes = t.numel() * t.element_size()
    if (n - 1) * nbytes <= SMALL_ALL_REDUCE_BYTES:
        return True
    return nbytes <= SHM_ALL_REDUCE_BYTES and _all_on_shm(group)


def shm_two_phase(op: str, group) -> bool:
    """Whether an all-reduce too big for one round goes as reduce-scatter + all-gather through shared memory.

    That is every rank of ``group`` on one host: each rank then moves about 1.5x the tensor
    through memory copies, where gloo's ring moves 1.5x through sockets in 2(n-1) steps.

    Example:
        >>> shm_two_phase("sum", None)
        False
    """
    return op in _REDUCE and _all_on_shm(group)


def _all_on_shm(group) -> bool:
    """Whether shared memory reaches every rank of ``group`` (the same answer on each of them)."""
    shm = shm_transport.active() if group is not None else None
    return shm is not None and _covered(group, shm) is not None


def all_reduce_two_phase(out: torch.Tensor, t: torch.Tensor, group, ranks: Sequence[int], op: str) -> torch.Tensor:
    """All-reduce of ``t`` (contiguous) into ``out`` (may be ``t``): reduce-scatter then all-gather, synchronous.

    The flat tensor is cut into ``n`` near-equal chunks; rank ``j`` reduces chunk ``j`` and
    sends it to every peer. ``avg`` is summed here, divided by the caller.

    Example:
        >>> all_reduce_two_phase(x, x, group, ranks, "sum")  # doctest: +SKIP
    """
    n = len(ranks)
    me = _group_layout(group, ranks)[0]
    flat_in, flat_out = t.view(-1), out.view(-1)
    step = max(1, -(-flat_in.numel() // n))
    ins, outs = list(flat_in.split(step)), list(flat_out.split(step))
    ins += [flat_in[:0]] * (n - len(ins))
    outs += [flat_out[:0]] * (n - len(outs))
    stacked = buffer_pool.empty((n, ins[me].numel()), t)
    _exchange(list(stacked.unbind(0)), ins, group, ranks).wait()
    reduce(stacked, op, out=outs[me])
    _exchange(outs, [outs[me]] * n, group, ranks).wait()
    return out


def all_reduce_into(t: torch.Tensor, group, ranks: Sequence[int]) -> tuple:
    """Post a direct all-reduce of ``t`` (contiguous): every rank's whole ``t`` to every peer.

    Returns ``(works, stacked)``: once the works are done, row ``j`` of ``stacked`` is rank
    ``j``'s ``t`` and :func:`reduce` gives the result. ``t`` itself is only read (it may be
    the output of that reduction once the works are done).

    Example:
        >>> works, stacked = all_reduce_into(torch.ones(3), group, ranks)  # doctest: +SKIP
    """
    n = len(ranks)
    stacked = buffer_pool.empty((n,) + tuple(t.shape), t)
    return _exchange(stacked, [t] * n, group, ranks), stacked


def reduce(stacked: torch.Tensor, op: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``stacked`` reduced over dim 0 with ``op`` (``avg`` is summed here, divided by the caller).

    Example:
        >>> reduce(torch.ones(4, 2), "sum")
        tensor([4., 4.])
    """
    if out is None:
        out = buffer_pool.empty(stacked.shape[1:], stacked)
    return _REDUCE[op](stacked, 0, out=out)


def can_reduce(op: str) -> bool:
    """Whether :func:`reduce` knows ``op``."""
    return op in _REDUCE


def all_to_all(out: torch.Tensor, t: torch.Tensor, group, ranks: Sequence[int],
               output_split_sizes: Optional[Sequence[int]], input_split_sizes: Optional[Sequence[int]]) -> Works:
    """Dim-0 slice ``j`` of ``t`` to rank ``j``; rank ``j``'s slice for us into slice ``j`` of ``out``.

    Example:
        >>> all_to_all(torch.empty(4), torch.arange(4.), group, ranks, None, None).wait()  # doctest: +SKIP
    """
    n = len(ranks)
    return _exchange(_split(out, output_split_sizes, n), _split(t, input_split_sizes, n), group, ranks)


class Pending(Works):
    """The messages of one :func:`exchange`: waiting also moves pieces that landed in a buffer into place.

    Receives are waited on in the order they were posted and each piece that could not be
    received in place is copied into its view as soon as it is in, while later ones travel.
    """

    __slots__ = ("_recvs",)

    def __init__(self, recvs, sends) -> None:
        super().__init__(sends)
        self._recvs = recvs

    def wait(self, timeout=None) -> bool:
        recvs, self._recvs = self._recvs, ()
        for work, view, buf in recvs:
            try:
                work.wait() if timeout is None else work.wait(timeout)
            except RuntimeError as e:
                raise _failed(e) from e
            if view is not None:
                view.copy_(buf)
        return super().wait(timeout)


def _staging(views: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """A contiguous buffer for each non-empty strided view (None for the others), cut from one allocation.

    One buffer for all of them, not one each: it is big enough to come from the pool (warm
    memory) where separate pieces would each be fresh and page-fault on every call.
    """
    need = [v.numel() and not v.is_contiguous() for v in views]
    total = sum(v.numel() for v, n in zip(views, need) if n)
    if not total:
        return [None] * len(views)
    first = next(v for v, n in zip(views, need) if n)
    if any(n and (v.dtype != first.dtype or v.device != first.device) for v, n in zip(views, need)):
        return [v.new_empty(v.shape) if n else None for v, n in zip(views, need)]
    flat = buffer_pool.empty((total,), first) if buffer_pool.plain(first) else first.new_empty((total,))
    out, o = [], 0
    for v, n in zip(views, need):
        if n:
            out.append(flat[o:o + v.numel()].view(v.shape))
            o += v.numel()
        else:
            out.append(None)
    return out


def exchange(sends: Sequence[tuple], recvs: Sequence[tuple], group, keep: Sequence[tuple] = (),
             recvs_first: bool = True) -> Pending:
    """Move pieces that may be strided views: receives posted first, each send packed just before it goes.

    ``sends`` and ``recvs`` hold ``(view, peer, tag)`` (``peer`` a rank within ``group``, a process
    group; both ends give a message the same tag). A receive whose view is one run of memory lands
    in place, any other in a staging buffer copied into the view on ``wait``. A send that is not
    contiguous is packed right before it is posted, so packing the next piece overlaps the previous
    one travelling; receives posted first let each message flow as soon as it is sent
    (``recvs_first=False`` posts them after the sends: as fast or faster measured for one message
    each way). The staging buffers of all strided pieces are cut from one pooled allocation.
    ``keep`` holds ``(src, dst)`` views copied locally after the messages are posted: one's own
    piece is never packed nor sent. Empty pieces are not sent (both ends know their sizes).

    Example:
        >>> w = exchange([(x[:, :2], 1, 0)], [(out[2:], 1, 0)], group, [(x[:, 2:], out[:2])])  # doctest: +SKIP
        >>> w.wait()  # doctest: +SKIP
        True
    """
    for view, _, _ in (*sends, *recvs):
        if not view.is_cpu:  # gloo's send/recv would hand the pointer to a socket and die (EFAULT)
            raise TypeError(f"shardprop: direct point-to-point messages carry host memory only, got a {view.device} "
                            "tensor; collectives.py stages device tensors through host memory (mesh/transport/staging.py)")
    shm = shm_transport.active()
    carried = _through_shm(shm, sends, recvs, group) if shm is not None else None
    shm_handles = []
    if carried is not None:
        shm_handles, sends, recvs = carried

    def post_recvs():
        for (view, peer, tag), buf in zip(recvs, _staging([v for v, _, _ in recvs])):
            if buf is not None:
                posted.append((group.recv([_wire(buf)], peer, tag), view, buf))
            elif view.numel():
                posted.append((group.recv([_wire(view)], peer, tag), None, None))
    posted, sent = [], []
    if recvs_first:
        post_recvs()
    for (view, peer, tag), buf in zip(sends, _staging([v for v, _, _ in sends])):
        if buf is not None:
            buf.copy_(view)
        elif view.numel():
            buf = view
        else:
            continue
        sent.append(group.send([_wire(buf)], peer, tag))  # the work holds ``buf`` until it left
    if not recvs_first:
        post_recvs()
    for src, dst in keep:
        dst.copy_(src)
    return Pending(shm_handles + posted if shm_handles else posted, sent)


_global_of: dict = {}


def _globals(group) -> tuple:
    """Each rank of ``group`` (by its number in the group) as a global rank."""
    hit = _global_of.get(group)
    if hit is None:
        if len(_global_of) > 1024:
            _global_of.clear()
        hit = _global_of[group] = tuple(dist.get_global_rank(group, i) for i in range(group.size()))
    return hit


_covered_by: dict = {}


def _covered(group, shm) -> Optional[tuple]:
    """The global ranks of ``group`` if shared memory reaches all of them from here, else None."""
    hit = _covered_by.get(group)
    if hit is None or hit[0] is not shm:
        if len(_covered_by) > 1024:
            _covered_by.clear()
        glob = _globals(group)
        hit = _covered_by[group] = (shm, glob if shm.covers(glob) else None)
    return hit[1]


def _through_shm(shm, sends: Sequence[tuple], recvs: Sequence[tuple], group):
    """Post the messages that shared memory carries (receives registered first, sends copied now).

    Returns ``(receive handles, sends left, receives left)`` for the process group, or None when
    shared memory carries none of them. Shared memory keeps one order per pair of ranks, where
    the group matches by tag: each side's messages are taken in tag order (tags are unique per
    pair within one call), so both ends agree.
    """
    ranks = _globals(group)
    carried = lambda view, peer: view.numel() and shm.carries(ranks[peer])
    mine_in = [m for m in recvs if carried(m[0], m[1])]
    mine_out = [m for m in sends if carried(m[0], m[1])]
    if not mine_in and not mine_out:
        return None
    by_tag = lambda m: m[2]
    handles = [(shm.recv(ranks[peer], view), None, None) for view, peer, _ in sorted(mine_in, key=by_tag)]
    for view, peer, _ in sorted(mine_out, key=by_tag):
        shm.send(ranks[peer], view)
    shm.flush()
    return (handles, [m for m in sends if not carried(m[0], m[1])],
            [m for m in recvs if not carried(m[0], m[1])])


_group_ranks: dict = {}


def exchange_global(sends: Sequence[tuple], recvs: Sequence[tuple], group, keep: Sequence[tuple] = (),
                    recvs_first: bool = True) -> Pending:
    """:func:`exchange` with peers given as global ranks, on ``group`` (None: the default group).

    Example:
        >>> exchange_global([(x[:, :2], 1, 0)], [(out[2:], 1, 0)], None).wait()  # doctest: +SKIP
        True
    """
    if group is None:  # the default group numbers ranks globally
        return exchange(sends, recvs, dist.group.WORLD, keep, recvs_first)
    local = _group_ranks.get(group)
    if local is None:
        if len(_group_ranks) > 1024:
            _group_ranks.clear()
        local = _group_ranks[group] = {g: i for i, g in enumerate(_globals(group))}
    return exchange([(v, local[p], t) for v, p, t in sends], [(v, local[p], t) for v, p, t in recvs], group, keep,
                    recvs_first)


def all_to_all_views(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], group,
                     ranks: Sequence[int]) -> Pending:
    """``ins[j]`` to rank ``j``, rank ``j``'s piece for us into ``outs[j]``; views of any strides.

    One's own piece is copied from ``ins`` to ``outs`` directly.

    Example:
        >>> x = torch.arange(16.).view(4, 4); out = torch.empty(16, 1)  # doctest: +SKIP
        >>> all_to_all_views(list(out.chunk(4)), list(x.chunk(4, 1)), group, ranks).wait()  # doctest: +SKIP
        True
    """
    return _exchange(outs, ins, group, ranks)


def _split(t: torch.Tensor, sizes: Optional[Sequence[int]], n: int) -> List[torch.Tensor]:
    if sizes is None:
        return list(t.view((n, t.shape[0] // n) + tuple(t.shape[1:])).unbind(0))
    return list(t.split(list(sizes), 0))


__all__ = ["MAX_GROUP", "Pending", "Works", "all_gather", "all_reduce_into", "all_reduce_two_phase", "all_to_all",
           "all_to_all_views", "can_reduce", "exchange", "exchange_global", "reduce", "reduce_scatter_into",
           "set_enabled", "shm_two_phase", "small_all_reduce", "usable"]
