"""Collectives along one mesh dim (or a set of mesh dims), sync or async.

All of them work on dim 0 of one contiguous buffer: all-gather writes every
rank's piece into one output, reduce-scatter reads every piece from one input,
all-to-all sends dim-0 slices. Callers lay tensors out so that no flatten or
unflatten copy is needed (redistribute.py does that). With ``async_op=True``
each returns an :class:`AsyncTensor` that waits on first use.

Every collective issued here is counted while a :func:`comm_counter` is active
(one global check when none is). This module is the only place shardprop
issues collectives for tensor data, so the counter sees all of them.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from shardprop.mesh.transport import buffer_pool, staging
from shardprop.mesh import compat
from shardprop.mesh.config import values as _settings
from shardprop.mesh.transport import direct_collectives as direct
from shardprop.mesh.async_tensor import AsyncTensor, wait_all
# Counting lives beside: every collective issued here is counted while a counter is active.
from shardprop.mesh.comm_count import CommCounter, comm_counter, count as _count, state as _state  # noqa: F401

_all_gather_flat = compat.all_gather_flat
# Every public collective runs beneath the user's dispatch modes (why: compat.beneath_dispatch_modes).
_beneath_modes = compat.beneath_dispatch_modes
_reduce_scatter_flat = compat.reduce_scatter_flat

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}

MeshDims = Union[int, str, Tuple[int, ...]]

def resolve(mesh, dims: MeshDims):
    """(group, ranks of this rank's group, group size) along ``dims`` of ``mesh``.

    Example:
        >>> group, ranks, n = resolve(mesh, "tp")  # doctest: +SKIP
    """
    if not isinstance(dims, tuple):
        dims = (mesh.dim_index(dims),)
    entry = mesh.group_for(dims)
    if entry is None or entry[0] is None:
        raise RuntimeError(f"shardprop: no process group for mesh dims {dims} of {mesh} on this rank")
    group, ranks = entry
    return group, ranks, len(ranks)


# ---------------------------------------------------------------- traced (torch.compile)
# While torch.compile traces, local tensors are fake or functional tensors and a c10d call
# cannot run on them. The same collectives then go through ``torch.ops._c10d_functional``:
# they return new tensors, name the group by its string name, and need ``wait_tensor``
# before use, so the graph carries them and a compiler can move them (seed 003).
@functools.lru_cache(maxsize=None)
def _traced_types() -> tuple:
    # Imported at the first use: torch's fake tensors are not needed to import shardprop.
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    return (FakeTensor, FunctionalTensor)


def is_traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake or functional tensor that torch.compile traces, not data.

    Callers test ``type(t) is not torch.Tensor`` first, so eager collectives pay one type check.

    Example:
        >>> is_traced(torch.ones(2))
        False
    """
    return isinstance(t, _traced_types())


def _functional(kind: str, t: torch.Tensor, group, n: int, op: str = "sum", out_split=None, in_split=None):
    """The traceable twin of one collective: ``_c10d_functional.<kind>`` then ``wait_tensor``."""
    f = torch.ops._c10d_functional
    name = group.group_name
    rop = "sum" if op == "avg" else op  # avg is a sum divided afterwards, as in eager
    device = t.device
    if device.type != "cpu" and staging.decide(kind, t, group) == staging.STAGE:
        # Staged in the graph itself: to host, the collective, back (mesh/transport/staging.py says where).
        return _functional(kind, t.cpu(), group, n, op, out_split, in_split).to(device)
    if kind == "all_gather":
        out = f.all_gather_into_tensor(t, n, name)
    elif kind == "reduce_scatter":
        out = f.reduce_scatter_tensor(t, rop, n, name)
    elif kind == "all_reduce":
        out = f.all_reduce(t, rop, name)
    else:  # all_to_all
        out = f.all_to_all_single(t, list(out_split), list(in_split), name)
    return f.wait_tensor(out)


def _finish(out: torch.Tensor, work, async_op: bool, after=None, shape=None):
    """Return the result now, or an AsyncTensor that runs ``after`` once the work is done."""
    if async_op:
        return AsyncTensor(work, out, after, shape)
    return after(out) if after is not None else out


def _then(first, second):
    if first is None:
        return second
    if second is None:
        return first
    return lambda t: second(first(t))


def _avg(n: int):
    return lambda t: t.div_(n)


# ---------------------------------------------------------------- staging through host memory
# Where the group's backend cannot read the tensor's memory (staging.TABLE: gloo has no CUDA
# send/recv, for one), a call runs on host copies and its result is copied back. Staged calls
# complete before they return; with ``async_op`` their AsyncTensor is already done.

def _staged(call: str, t: torch.Tensor, group) -> bool:
    """Whether ``call`` of ``t`` goes through host memory; callers test ``t.is_cpu`` / ``_forced`` first."""
    if type(t) is not torch.Tensor and is_traced(t):
        return False
    return staging.decide(call, t, group) == staging.STAGE


def _on_host(fn, t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``fn`` (a collective of this module) on a host copy of ``t``, never staged again."""
    with staging.host_call():
        return fn(staging.to_host(t), *args, **kwargs)


def _done(out: torch.Tensor, async_op: bool, finish=None, shape=None):
    """A staged call's result: finished now, or as an AsyncTensor that is already complete."""
    if async_op:
        return AsyncTensor(None, out, finish, shape)
    return finish(out) if finish is not None else out


@_beneath_modes
def all_gather(t: torch.Tensor, mesh, dims: MeshDims, *, async_op: bool = False, finish=None,
               finish_shape=None, pooled: bool = True) -> torch.Tensor:
    """Gather equal-sized pieces along dim 0 into one new contiguous tensor.

    ``pooled=False``: a fresh output, never one the buffer pool keeps for reuse (for an output
    copied out and dropped at once, whose memory would otherwise stay with the pool).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> all_gather(torch.ones(2, 3), mesh, 0).shape  # 4 ranks
        torch.Size([8, 3])
    """
    group, ranks, n = resolve(mesh, dims)
    t = wait_all(t).contiguous()
    if not t.ndim:  # a 0-d piece gathers into a 1-d tensor (the backends want matching ranks)
        t = t.reshape(1)
    if (not t.is_cpu or _settings.force_staging) and _staged("all_gather", t, group):
        return _done(staging.to_device(_on_host(all_gather, t, mesh, dims), t), async_op, finish, finish_shape)
    if _state.counters:
        _count("all_gather", t, n)
    if type(t) is not torch.Tensor and is_traced(t):
        out = _functional("all_gather", t, group, n)
        return finish(out) if finish is not None else out
    shape = (n * t.shape[0],) + tuple(t.shape[1:])
    out = buffer_pool.empty(shape, t) if pooled else t.new_empty(shape)
    if direct.usable(t, n):
        work = direct.all_gather(out, t, group, ranks)
        if not async_op:
            work.wait()
    else:
        work = _all_gather_flat(out, t, group=group, async_op=async_op)
    return _finish(out, work, async_op, finish, finish_shape)


@_beneath_modes
def reduce_scatter(t: torch.Tensor, mesh, dims: MeshDims, op: str = "sum", *, async_op: bool = False, finish=None,
                   finish_shape=None) -> torch.Tensor:
    """Reduce one contiguous input across ranks and keep this rank's dim-0 piece.

    ``t.shape[0]`` must divide by the group size.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> reduce_scatter(torch.ones(8, 3), mesh, 0).shape  # 4 ranks
        torch.Size([2, 3])
    """
    group, ranks, n = resolve(mesh, dims)
    t = wait_all(t).contiguous()
    if (not t.is_cpu or _settings.force_staging) and _staged("reduce_scatter", t, group):
        out = staging.to_device(_on_host(reduce_scatter, t, mesh, dims, op), t)
        return _done(out, async_op, finish, finish_shape)
    if _state.counters:
        _count("reduce_scatter", t, n)
    if type(t) is not torch.Tensor and is_traced(t):
        out = _functional("reduce_scatter", t, group, n, op)
        out = out / n if op == "avg" else out
        return finish(out) if finish is not None else out
    if direct.usable(t, n) and direct.can_reduce(op):
        work, stacked = direct.reduce_scatter_into(t, group, ranks)
        after = _then(lambda s: direct.reduce(s, op), _then(_avg(n) if op == "avg" else None, finish))
        if async_op:
            return AsyncTensor(work, stacked, after, finish_shape or stacked.shape[1:])
        work.wait()
        return after(stacked)
    out = buffer_pool.empty((t.shape[0] // n,) + tuple(t.shape[1:]), t)
    work = _reduce_scatter_flat(out, t, op=_REDUCE_OPS[op], group=group, async_op=async_op)
    return _finish(out, work, async_op, _then(_avg(n) if op == "avg" else None, finish), finish_shape)


@_beneath_modes
def all_reduce(t: torch.Tensor, mesh, dims: MeshDims, op: str = "sum", *, async_op: bool = False,
               inplace: bool = False) -> torch.Tensor:
    """All-reduce; into a fresh tensor unless ``inplace`` (when the caller owns ``t``).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> all_reduce(torch.ones(3), mesh, 0)  # 4 ranks
        tensor([4., 4., 4.])
    """
    group, ranks, n = resolve(mesh, dims)
    t = wait_all(t)
    if n == 1:
        # Over one rank (a tp=1 mesh, say) every reduction is the identity: no collective, no
        # count, as the redistribution planner skips mesh dims of size 1. The result keeps the
        # layout the collective would give (``t`` itself in place, else a fresh contiguous copy).
        out = t if inplace and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)
        return _done(out, async_op)
    if (not t.is_cpu or _settings.force_staging) and _staged("all_reduce", t, group):
        host = _on_host(all_reduce, t, mesh, dims, op, inplace=True)
        return _done(t.copy_(host) if inplace else staging.to_device(host, t), async_op)
    if type(t) is not torch.Tensor and is_traced(t):
        if _state.counters:
            _count("all_reduce", t, n)
        out = _functional("all_reduce", t.contiguous(), group, n, op)
        return out / n if op == "avg" else out
    if direct.usable(t, n) and direct.small_all_reduce(t, n, op, group):
        # One round of messages; ``t`` is only read, so no copy of a tensor the caller keeps.
        t = t.contiguous()
        if _state.counters:
            _count("all_reduce", t, n)
        out = t if inplace else buffer_pool.empty_like(t)
        work, stacked = direct.all_reduce_into(t, group, ranks)
        after = _then(lambda s: direct.reduce(s, op, out), _avg(n) if op == "avg" else None)
        if async_op:
            return AsyncTensor(work, stacked, after, t.shape)
        work.wait()
        return after(stacked)
    if not async_op and direct.usable(t, n) and direct.shm_two_phase(op, group):
        # Bigger tensors between ranks of one host: reduce-scatter + all-gather through shared
        # memory (measured 1.2-1.7x faster than gloo's ring from 2 to 64 MB on 4 ranks).
        t = t.contiguous()
        if _state.counters:
            _count("all_reduce", t, n)
        out = direct.all_reduce_two_phase(t if inplace else buffer_pool.empty_like(t), t, group, ranks, op)
        return _avg(n)(out) if op == "avg" else out
    if inplace and t.is_contiguous():
        out = t
    elif buffer_pool.plain(t):
        out = buffer_pool.empty_like(t).copy_(t)
    else:
        out = t.clone(memory_format=torch.contiguous_format)
    if _state.counters:
        _count("all_reduce", out, n)
    work = dist.all_reduce(out, op=_REDUCE_OPS[op], group=group, async_op=async_op)
    return _finish(out, work, async_op, _avg(n) if op == "avg" else None)


@_beneath_modes
def all_to_all(t: torch.Tensor, mesh, dims: MeshDims, output_split_sizes: Optional[Sequence[int]] = None,
               input_split_sizes: Optional[Sequence[int]] = None, *, out: Optional[torch.Tensor] = None,
               async_op: bool = False, finish=None, finish_shape=None, views=None) -> torch.Tensor:
    """Send dim-0 slice i of ``t`` to rank i of the group; receive into one tensor.

    Split sizes count dim-0 rows; None means equal splits.

    ``views=(outs, ins)`` (only where :func:`views_usable`; ``out`` given): the pieces are views
    of any strides, ``ins[j]`` (of ``t``) to rank ``j`` and rank ``j``'s piece into ``outs[j]``
    (of ``out``). Nothing packs the whole input: each peer's strided piece is packed right before
    it is sent, one's own piece is copied straight from ``ins`` into ``outs`` (never packed nor
    sent), and pieces whose place in ``out`` is one run of memory are received in place; the
    others are staged and copied into place as they arrive. Split sizes are then unused.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> all_to_all(torch.full((4,), float(dist.get_rank())), mesh, 0)  # element i from rank i
        tensor([0., 1., 2., 3.])
        >>> out = torch.empty(8, 2)  # S(0) -> S(1) of an (8, 8) tensor on 4 ranks  # doctest: +SKIP
        >>> all_to_all(local, mesh, 0, out=out, views=(out.chunk(4), local.chunk(4, 1)))  # doctest: +SKIP
    """
    group, ranks, n = resolve(mesh, dims)
    if views is not None:
        if _state.counters:
            _count("all_to_all", t, n)
        work = direct.all_to_all_views(views[0], views[1], group, ranks)
        if not async_op:
            work.wait()
        return _finish(out, work, async_op, finish, finish_shape)
    t = wait_all(t).contiguous()
    if (not t.is_cpu or _settings.force_staging) and _staged("all_to_all", t, group):
        host = _on_host(all_to_all, t, mesh, dims, output_split_sizes, input_split_sizes)
        out = out.copy_(host) if out is not None else staging.to_device(host, t)
        return _done(out, async_op, finish, finish_shape)
    if _state.counters:
        _count("all_to_all", t, n)
    if out is None and type(t) is not torch.Tensor and is_traced(t):
        even = [t.shape[0] // n] * n
        res = _functional("all_to_all", t, group, n, out_split=output_split_sizes or even,
                          in_split=input_split_sizes or even)
        return finish(res) if finish is not None else res
    if out is None:
        rows = sum(output_split_sizes) if output_split_sizes is not None else t.shape[0]
        out = buffer_pool.empty((rows,) + tuple(t.shape[1:]), t)
    if direct.usable(t, n) and out.is_contiguous():
        work = direct.all_to_all(out, t, group, ranks, output_split_sizes, input_split_sizes)
        if not async_op:
            work.wait()
        return _finish(out, work, async_op, finish, finish_shape)
    work = dist.all_to_all_single(out, t, output_split_sizes=list(output_split_sizes) if output_split_sizes is not None else None,
                                  input_split_sizes=list(input_split_sizes) if input_split_sizes is not None else None,
                                  group=group, async_op=async_op)
    return _finish(out, work, async_op, finish, finish_shape)


def views_usable(t: torch.Tensor, mesh, dims: MeshDims) -> bool:
    """Whether :func:`all_to_all` can move pieces of ``t`` given as ``views`` (an eager CPU tensor, a small group).

    Example:
        >>> views_usable(local, mesh, 0)  # doctest: +SKIP
        True
    """
    if not isinstance(dims, tuple):
        dims = (mesh.dim_index(dims),)
    n = 1
    for d in dims:
        n *= mesh.shape[d]
    return direct.usable(t, n) and not staging.forced()  # forced staging: as a CUDA tensor would go


@_beneath_modes
def broadcast(t: torch.Tensor, mesh, dims: MeshDims, src: int = 0, *, async_op: bool = False) -> torch.Tensor:
    """Broadcast ``t`` from index ``src`` of the group (in place on ``t``).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        >>> broadcast(torch.full((2,), float(dist.get_rank())), mesh, "tp", src=0)  # every rank gets rank 0's
        tensor([0., 0.])
    """
    group, ranks, _ = resolve(mesh, dims)
    t = wait_all(t)
    if (not t.is_cpu or _settings.force_staging) and _staged("broadcast", t, group):
        return _done(t.copy_(_on_host(broadcast, t, mesh, dims, src)), async_op)
    if _state.counters:
        _count("broadcast", t, len(ranks))
    if type(t) is not torch.Tensor and is_traced(t):  # functional: a new tensor, not in place
        f = torch.ops._c10d_functional
        return f.wait_tensor(f.broadcast(t.contiguous(), src, group.group_name))
    work = dist.broadcast(t, src=ranks[src], group=group, async_op=async_op)
    return _finish(t, work, async_op)


@_beneath_modes
def scatter(chunks: Optional[List[torch.Tensor]], out: torch.Tensor, mesh, dims: MeshDims, src: int = 0, *,
            async_op: bool = False) -> torch.Tensor:
    """Scatter equal-sized ``chunks`` (given on the source only) into ``out`` on every rank.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> full = torch.arange(8.)
        >>> scatter(list(full.chunk(4)) if dist.get_rank() == 0 else None, torch.empty(2), mesh, 0)  # rank 0's piece
        tensor([0., 1.])
    """
    group, ranks, _ = resolve(mesh, dims)
    me = dist.get_rank()
    if (not out.is_cpu or _settings.force_staging) and _staged("scatter", out, group):
        with staging.host_call():
            host = scatter([staging.to_host(c) for c in chunks] if me == ranks[src] else None,
                           staging.host_empty(out), mesh, dims, src)
        return _done(out.copy_(host), async_op)
    if _state.counters:
        _count("scatter", out, len(ranks))
    work = dist.scatter(out, [c.contiguous() for c in chunks] if me == ranks[src] else None,
                        src=ranks[src], group=group, async_op=async_op)
    return _finish(out, work, async_op)


class _CoalescedWork:
    """The work of a coalesced group of collectives: one wait for all of them."""

    def __init__(self, cm) -> None:
        self._cm = cm

    def wait(self, timeout=None) -> bool:
        self._cm.wait()
        return True


def _coalesced(kind: str, pairs, group, issue, async_op: bool, result: torch.Tensor, nbytes: int):
    if _state.counters:
        for c in _state.counters:
            c.add(kind, nbytes)
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        for out, inp in pairs:
            issue(out, inp)
    work = _CoalescedWork(cm)
    if async_op:
        return AsyncTensor(work, result)
    work.wait()
    return result


@_beneath_modes
def all_gather_into_views(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], result: torch.Tensor,
                          mesh, dims: MeshDims, *, async_op: bool = False) -> torch.Tensor:
    """One all-gather of several dim-0 pieces, each into its own output view (counted as one collective).

    ``outputs[i]`` receives every rank's ``inputs[i]`` stacked along dim 0. When the outputs
    are views of one flat buffer ``result`` (which is returned, or an AsyncTensor of it),
    the gathered tensors are ready to use in place: there is no unflatten copy on our side.

    Example:
        >>> full = torch.empty(10); a, b = full[:4].view(2, 2), full[4:].view(2, 3)  # doctest: +SKIP
        >>> all_gather_into_views([a, b], [x1, x2], full, mesh, 0)  # 2 ranks  # doctest: +SKIP
    """
    group, _, _ = resolve(mesh, dims)
    if inputs and (not inputs[0].is_cpu or _settings.force_staging) and _staged("all_gather_views", inputs[0], group):
        # Host outputs of their own (not views of one host buffer): each is copied into its view after.
        houts = [staging.host_empty(o) for o in outputs]
        with staging.host_call():
            all_gather_into_views(houts, [staging.to_host(i) for i in inputs], houts[0] if houts else result,
                                  mesh, dims)
        for o, h in zip(outputs, houts):
            o.copy_(h)
        return _done(result, async_op)
    nbytes = sum(t.numel() * t.element_size() for t in inputs)
    return _coalesced("all_gather", list(zip(outputs, inputs)), group,
                      lambda o, i: _all_gather_flat(o, i, group=group), async_op, result, nbytes)



def p2p_group(mesh):
    """The process group point-to-point messages within ``mesh`` travel on (peers are global ranks).

    The group spanning every mesh dim when the mesh has one (messages of one mesh never meet
    another's), else the default group.

    Example:
        >>> p2p_group(mesh)  # doctest: +SKIP
    """
    entry = mesh.group_for(tuple(range(mesh.ndim)))
    return entry[0] if entry is not None else None


def _packed(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if contiguous, else a contiguous copy (a reused buffer for big eager ones: no page faults).

    The copy is held by the send's work until the message left, so the pool hands it out again
    only after that.
    """
    if t.is_contiguous():
        return t
    if buffer_pool.plain(t):
        return buffer_pool.empty(t.shape, t).copy_(t)
    return t.contiguous()


@_beneath_modes
def send_recv(sends: Sequence[Tuple[torch.Tensor, int, int]], recvs: Sequence[Tuple[torch.Tensor, int, int]], group,
              result: torch.Tensor, *, async_op: bool = False, finish=None, finish_shape=None,
              keep: Sequence[Tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
    """Send and receive pieces point to point; return ``result``.

    ``sends`` and ``recvs`` hold ``(view, peer, tag)`` with ``peer`` a global rank and ``tag``
    the same number on both ends of a message; ``group`` is the process group they travel on
    (:func:`p2p_group` of a mesh; None: the default group, e.g. between two meshes). Views may be
    strided: a receive lands in place where its view is one run of memory (views of ``result``),
    else in a buffer copied into the view once it arrived; a strided send is packed first.
    ``keep`` holds ``(src, dst)`` local copies (a piece that stays on this rank; it must touch no
    buffer of a message), done while the messages travel. ``finish`` runs once everything
    arrived. Counted as ``send`` and ``recv``.

    On eager CPU tensors :func:`direct_collectives.exchange_global` posts them (each strided send
    packed right before it goes, strided receives staged in one pooled buffer); elsewhere one
    ``batch_isend_irecv`` moves them.

    Example:
        >>> out = torch.empty(4)  # doctest: +SKIP
        >>> send_recv([(mine, 1, 0)], [(out, 1, 0)], p2p_group(mesh), out)  # ranks 0 and 1 swap  # doctest: +SKIP
    """
    probe = sends[0][0] if sends else recvs[0][0] if recvs else result
    if (not probe.is_cpu or _settings.force_staging) and _staged("send_recv", probe, group):
        return _send_recv_staged(sends, recvs, group, result, async_op, finish, finish_shape, keep)
    if _state.counters:
        for t, _, _ in sends:
            _count("send", t)
        for t, _, _ in recvs:
            _count("recv", t)
    if direct.usable(result, 2):
        # One message each way per pair here: posting the receives after the sends measured as
        # fast or faster (receives first: 1.1-1.3x at 1 MB on [S(0),S(0)] -> [S(0),S(1)] 2x2).
        work = direct.exchange_global(sends, recvs, group, keep, recvs_first=False)
        if not async_op:
            work.wait()
        return _finish(result, work, async_op, finish, finish_shape)
    scattered, posted = [], []
    for t, peer, tag in recvs:
        if not t.is_contiguous():  # received whole, copied into place after
            buf = buffer_pool.empty(t.shape, t) if buffer_pool.plain(t) else t.new_empty(t.shape)
            scattered.append((t, buf))
            t = buf
        posted.append(dist.P2POp(dist.irecv, t, peer, group, tag))
    ops = [dist.P2POp(dist.isend, _packed(t), peer, group, tag) for t, peer, tag in sends] + posted
    work = direct.Works(dist.batch_isend_irecv(ops) if ops else [], direct=False)
    for src, dst in keep:
        dst.copy_(src)
    if not async_op:
        work.wait()
    if scattered:
        def finish(res, then=finish):
            for view, buf in scattered:
                view.copy_(buf)
            return then(res) if then is not None else res
    return _finish(result, work, async_op, finish, finish_shape)


def _send_recv_staged(sends, recvs, group, result, async_op, finish, finish_shape, keep):
    """:func:`send_recv` through host memory: sends copied out, receives landed in host buffers and copied in."""
    hrecvs = [(staging.host_empty(v), p, tag) for v, p, tag in recvs]
    with staging.host_call():
        send_recv([(staging.to_host(v), p, tag) for v, p, tag in sends], hrecvs, group,
                  staging.host_empty(result, (0,)))
    for (view, _, _), (h, _, _) in zip(recvs, hrecvs):
        view.copy_(h)
    for src, dst in keep:
        dst.copy_(src)
    return _done(result, async_op, finish, finish_shape)
