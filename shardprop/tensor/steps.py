"""Redistribution steps prepared once: each plan step as a closure with its shape arithmetic done.

A plan (``redistribute.py``) says *which* collective runs on which mesh dims; running it needs
shapes, chunk bounds, padding, split sizes and the layout fix-up after the collective. Those
depend only on the source spec, the plan and this rank's coordinate, so :func:`prepare` works
them out once and returns a :class:`Program`: one closure per step doing only the tensor work
(at most one copy, the collective, views). The plan keeps its program, so a repeated
redistribution (the common case: the same layout change every step of training) pays a
lookup, not the arithmetic.

The closures read shapes from the spec at preparation, never the data; they keep no tensor.
Under torch.compile (fake tensors) a program is prepared on every call, as the arithmetic
ran before, so traced graphs are unchanged.

Example:
    >>> prog = prepare(spec, plan, local.shape)  # doctest: +SKIP
    >>> new_local = run(prog, local, owned=False, async_op=False)  # doctest: +SKIP
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Tuple

import torch

from shardprop.mesh.transport import buffer_pool
from shardprop.mesh import collectives as C
from shardprop.mesh import compat
from shardprop.mesh.async_tensor import wait_all
from shardprop.tensor import permute
from shardprop.tensor.layout import chunk_bounds
from shardprop.tensor.placement import Replicate, partial_fill
from shardprop.tensor.strided_steps import prep_strided_chunk, prep_strided_gather

# Steps after which the local tensor is a new buffer of ours (a collective's output).
MOVES = frozenset({"all_gather", "all_to_all", "reduce_scatter", "all_reduce", "p2p", "strided_gather"})
# Steps that may reuse a caller's tensor handed over (in-place all-reduce, a view of it).
USES_OWNED = frozenset({"all_reduce", "chunk", "to_partial", "p2p"})


class Program(NamedTuple):
    """One plan prepared for one source spec and local shape."""

    src: object                       # the DTensorSpec it was prepared for
    in_shape: Tuple[int, ...]         # the local shape it was prepared for
    steps: Tuple[Callable, ...]       # step(local, owned, async_op) -> new local
    moves: Tuple[bool, ...]           # whether step i hands back a buffer of ours
    wants_owned: bool                 # whether a caller's handed-over tensor can be used at all
    call: Callable                    # call(local, owned, async_op) -> new local: the whole program


def prepare(src, plan, in_shape) -> Program:
    """The program running ``plan`` on a local shard of shape ``in_shape`` laid out as ``src``.

    Example:
        >>> prepare(spec, plan_redistribute(spec, (Replicate(),)), local.shape).steps  # doctest: +SKIP
    """
    in_shape = tuple(in_shape)
    if 0 in src.tensor_meta.shape:  # nothing to move: the right empty shard (no numel(): symbolic sizes)
        shape, _ = src.local_box(_final(src, plan))

        def empty(local, owned, async_op):
            return local.new_empty(shape)
        return Program(src, torch.Size(in_shape), (empty,), (True,), False, empty)
    cur = list(src.placements)
    shape = in_shape
    steps, moves = [], []
    wants = False
    for step in plan.steps:
        fn, shape = _PREP[step.kind](step, cur, src, shape)
        steps.append(fn)
        if not any(moves):
            wants = wants or step.kind in USES_OWNED
        moves.append(step.kind in MOVES)
        for m, p in zip(step.mesh_dims, step.dst):
            cur[m] = p
    steps, moves = tuple(steps), tuple(moves)
    # The common one-step program is its step itself: running it costs one call.
    call = steps[0] if len(steps) == 1 else _chain(steps, moves)
    # Beneath the user's dispatch modes, as the collectives: a selective-checkpoint policy sees the
    # compute around a redistribution, never its copies into our buffers (compat.beneath_dispatch_modes).
    call = compat.beneath_dispatch_modes(call)
    # A torch.Size: comparing it with a local tensor's shape is one C-level tuple comparison.
    return Program(src, torch.Size(in_shape), steps, moves, wants, call)


def _chain(steps, moves) -> Callable:
    """The steps run one after the other (none: the local tensor as is)."""
    if not steps:
        def nothing(local, owned, async_op):
            return local
        return nothing
    last = len(steps) - 1

    def chain(local, owned, async_op):
        for i, fn in enumerate(steps):
            local = fn(local, owned, async_op and i == last)
            owned = owned or moves[i]
        return local
    return chain


def run(prog: Program, local: torch.Tensor, owned: bool, async_op: bool) -> torch.Tensor:
    """Run a prepared program; ``owned`` as in ``redistribute_local`` (the caller hands ``local`` over).

    Example:
        >>> run(prog, local, False, False)  # doctest: +SKIP
    """
    return prog.call(local, owned, async_op)


def _final(src, plan):
    cur = list(src.placements)
    for step in plan.steps:
        for m, p in zip(step.mesh_dims, step.dst):
            cur[m] = p
    return cur


def _parent_len(spec, cur, m: int, dim: int) -> int:
    """Extent of ``dim`` that mesh dim ``m`` splits, on this rank (earlier mesh dims applied)."""
    before = [p if k < m else Replicate() for k, p in enumerate(cur)]
    return spec.local_box(before)[0][dim]


def _with(shape, dim: int, size) -> list:
    out = list(shape)
    out[dim] = size
    return out


def pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` zero-padded at the end of ``dim`` to ``size`` (``t`` itself when it already is)."""
    if t.shape[dim] == size:
        return t
    shape = _with(t.shape, dim, size)
    out = buffer_pool.empty(shape, t).zero_() if buffer_pool.plain(t) else t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


# Below this, one ``clone`` beats taking a pooled buffer and copying into it (4 gloo ranks on
# 2 cores, a barrier before each call: 0.10 vs 0.14 ms for 256 KB, 0.33 vs 0.40 ms for 1 MB;
# even at 4 MB; the pool wins from 16 MB, 3.5 vs 4.9 ms, where a fresh buffer page-faults).
COPY_POOL_MIN = 4 << 20


def copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` (a plain tensor), into a reused buffer where one is free and big."""
    # An eager tensor's size first: most copies are small, and then plain() need not be asked.
    if (type(t) is torch.Tensor and t.numel() * t.element_size() < COPY_POOL_MIN) or not buffer_pool.plain(t):
        return t.clone(memory_format=torch.contiguous_format)  # traced: the usual op, graphs unchanged
    return buffer_pool.empty(t.shape, t).copy_(t)


def _into(shape, b: torch.Tensor) -> torch.Tensor:
    """``b`` (a permuted view) copied into a new contiguous tensor of ``shape`` (same elements)."""
    if type(b) is not torch.Tensor:
        return b.reshape(shape)  # the one layout copy (traced: the usual op, graphs unchanged)
    out = buffer_pool.empty(shape, b)  # the one layout copy, into a reused buffer where the pool allows
    out.view(b.shape).copy_(b)
    return out


# ---------------------------------------------------------------- one preparer per step kind
# Each returns (step closure, local shape after the step).
def _prep_gather(step, cur, spec, shape):
    if len(step.mesh_dims) > 1:
        return _prep_fused_gather(step, cur, spec, shape)
    mesh = spec.mesh
    m = step.mesh_dims[0]
    d = cur[m].dim
    k = mesh.shape[m]
    n = _parent_len(spec, cur, m, d)
    c = -(-n // k)
    pad = shape[d] != c
    piece = _with(shape, d, c)
    final = _with(shape, d, n)
    gathered = _with(shape, d, k * c)
    dims = (m,)
    if math.prod(piece[:d]) == 1:
        # The gathered buffer already is the tensor (padding sits at the end): views only.
        if d == 0 and n == k * c:
            fix = None
        elif n == k * c:
            def fix(buf):
                return buf.view(gathered)
        else:
            def fix(buf):
                return buf.view(gathered).narrow(d, 0, n)
    elif n == k * c:
        stacked = [k] + piece

        def fix(buf):
            return _into(gathered, buf.view(stacked).movedim(0, d))
    else:
        bounds = [chunk_bounds(n, k, r) for r in range(k)]
        stacked = [k] + piece

        def fix(buf):
            # Uneven: each rank's piece, padding dropped, straight into the final layout (still one copy).
            out = buffer_pool.empty(final, buf)
            pieces = buf.view(stacked)
            for r, (off, ln) in enumerate(bounds):
                if ln:
                    out.narrow(d, off, ln).copy_(pieces[r].narrow(d, 0, ln))
            return out

    def gather(local, owned, async_op):
        x = wait_all(local)
        if pad:
            x = pad_to(x, d, c)
        return C.all_gather(x, mesh, dims, async_op=async_op, finish=fix, finish_shape=final)
    return gather, tuple(final)


def _prep_fused_gather(step, cur, spec, shape):
    mesh = spec.mesh
    dims = step.mesh_dims
    ks = [mesh.shape[m] for m in dims]
    order = []  # output axes: for each tensor dim, the mesh axes sharding it (outermost first), then itself
    for d in range(len(shape)):
        order.extend(i for i, m in enumerate(dims) if cur[m].dim == d)
        order.append(len(dims) + d)
    full = list(shape)
    for i, m in enumerate(dims):
        full[cur[m].dim] *= ks[i]
    stacked = [*ks, *shape]

    def fix(buf):
        return _into(full, buf.view(stacked).permute(order))

    def gather(local, owned, async_op):
        return C.all_gather(wait_all(local), mesh, dims, async_op=async_op, finish=fix, finish_shape=full)
    return gather, tuple(full)


def _prep_all_to_all(step, cur, spec, shape):
    mesh = spec.mesh
    m = step.mesh_dims[0]
    dims = (m,)
    i, j = step.src[0].dim, step.dst[0].dim
    k = mesh.shape[m]
    me = mesh._coord[m]
    n_i, n_j = spec.shape[i], spec.shape[j]  # no other mesh dim shards i or j (planner's rule)
    rows_j = [chunk_bounds(n_j, k, r) for r in range(k)]
    rows_i = [chunk_bounds(n_i, k, r) for r in range(k)]
    inner = list(shape)
    row = math.prod(inner[1:])
    send_rows = [ln * row for _, ln in rows_j]       # j == 0: dim-0 slices of the input itself
    piece_numels = [math.prod(_with(inner, j, ln)) for _, ln in rows_j]
    even_j = j != 0 and n_j % k == 0
    # Even split of dim j: one copy packs every destination's piece (dim j split as (k, c), k first).
    split = inner[:j] + [k, n_j // k] + inner[j + 1:] if even_j else None
    packed = [k] + inner[:j] + [n_j // k] + inner[j + 1:] if even_j else None
    numel = math.prod(inner)
    shapes = []
    for _, ln in rows_i:
        s = _with(inner, i, ln)
        s[j] = rows_j[me][1]
        shapes.append(s)
    recv_sizes = [math.prod(s) for s in shapes]
    out_shape = _with(inner, i, n_i)
    out_shape[j] = rows_j[me][1]

    def fix(buf):
        if i == 0:
            return buf.view(out_shape)
        views = [p.view(s) for p, s in zip(torch.split(buf, recv_sizes), shapes)]
        if not buffer_pool.plain(buf):
            return torch.cat(views, dim=i)
        return torch.cat(views, dim=i, out=buffer_pool.empty(out_shape, buf))

    def all_to_all(local, owned, async_op):
        local = wait_all(local)
        if C.views_usable(local, mesh, dims):
            # Each peer's piece packed right before it is sent, one's own copied straight into
            # place, pieces received in place where their rows of ``out`` are one run (i == 0).
            out = buffer_pool.empty(out_shape, local)
            ins = [local.narrow(j, off, ln) for off, ln in rows_j]
            outs = [out.narrow(i, off, ln) for off, ln in rows_i]
            return C.all_to_all(local, mesh, dims, out=out, views=(outs, ins), async_op=async_op,
                                finish_shape=out_shape)
        if j == 0 and local.is_contiguous():
            flat_in, send = local.reshape(-1), send_rows
        else:
            flat_in, send = buffer_pool.empty((numel,), local), piece_numels
            if even_j and local.is_contiguous():
                flat_in.view(packed).copy_(local.view(split).movedim(j, 0))
            else:
                o = 0
                for (off, ln), cnt in zip(rows_j, piece_numels):
                    piece = local.narrow(j, off, ln)
                    flat_in[o:o + cnt].view(piece.shape).copy_(piece)
                    o += cnt
        return C.all_to_all(flat_in, mesh, dims, recv_sizes, send, async_op=async_op, finish=fix,
                            finish_shape=out_shape)
    return all_to_all, tuple(out_shape)


def _prep_reduce_scatter(step, cur, spec, shape):
    mesh = spec.mesh
    m = step.mesh_dims[0]
    dims = (m,)
    op = step.src[0].reduce_op
    d = step.dst[0].dim
    k = mesh.shape[m]
    n = _parent_len(spec, cur, m, d)
    c = -(-n // k)
    _, ln = chunk_bounds(n, k, mesh._coord[m])
    padded = k * c
    pad = shape[d] != padded
    pre, post = list(shape[:d]), list(shape[d + 1:])
    final = _with(shape, d, ln)
    # The k chunks of dim d stacked on dim 0 (one copy when d != 0): the collective's output is
    # then this rank's chunk already laid out as the final shard, with no copy after it.
    stacked = pre + [k, c] + post
    mine = pre + [c] + post
    if d == 0:
        # Dim 0 is already in collective order: the output is (c, ...), the final shard when even.
        fix = None if ln == c else (lambda out: out.narrow(0, 0, ln))  # uneven: a view without the padding
    elif ln == c and not pad:
        def fix(out):
            return out.view(mine)  # even: the output is this rank's chunk, laid out already
    else:
        def fix(out):
            res = out.view(mine).narrow(d, 0, ln)
            return res if res.is_contiguous() else copy(res)  # uneven: drop the padding

    def reduce_scatter(local, owned, async_op):
        x = wait_all(local)
        if pad:
            x = pad_to(x, d, padded)
        if d:
            x = x.reshape(stacked).movedim(d, 0)
            if type(x) is torch.Tensor:  # eager; traced, the collective's contiguous() is the copy
                x = copy(x)  # the one pack copy, into a reused buffer where big
        return C.reduce_scatter(x, mesh, dims, op, async_op=async_op, finish=fix, finish_shape=final)
    return reduce_scatter, tuple(final)


def _prep_all_reduce(step, cur, spec, shape):
    mesh, dims, op = spec.mesh, step.mesh_dims, step.src[0].reduce_op

    def all_reduce(local, owned, async_op):
        return C.all_reduce(local, mesh, dims, op, async_op=async_op, inplace=owned)
    return all_reduce, shape


def _prep_chunk(step, cur, spec, shape):
    m = step.mesh_dims[0]
    d = step.dst[0].dim
    n = _parent_len(spec, cur, m, d)
    off, ln = chunk_bounds(n, spec.mesh.shape[m], spec.mesh._coord[m])
    # A view of a tensor we own (a gathered buffer, a temporary handed over) is safe, but it keeps
    # all of that memory alive: only where the piece is at least half of it.
    big = 2 * ln >= shape[d]

    def chunk(local, owned, async_op):
        piece = wait_all(local).narrow(d, off, ln)
        # Never hand back a view of the caller's tensor: an in-place op on the new shard would
        # silently change the replicated original.
        if owned and big and piece.is_contiguous():
            return piece
        return copy(piece)
    return chunk, tuple(_with(shape, d, ln))


def _prep_to_partial(step, cur, spec, shape):
    m = step.mesh_dims[0]
    # Sum and product keep the value on index 0 and their identity elsewhere; avg/max/min keep it everywhere.
    identity = partial_fill(step.dst, (spec.mesh._coord[m],))

    def to_partial(local, owned, async_op):
        if identity is not None:
            return torch.full_like(wait_all(local), identity)
        return local if owned else copy(wait_all(local))
    return to_partial, shape


def _prep_p2p(step, cur, spec, shape):
    src, dst = step.src, step.dst

    def p2p(local, owned, async_op):
        return permute.run_p2p(local, spec, src, dst, owned, async_op)
    return p2p, tuple(spec.local_box(dst)[0])


def _prep_strided_gather(step, cur, spec, shape):
    m = step.mesh_dims[0]
    return prep_strided_gather(step, cur, spec, shape, _parent_len(spec, cur, m, cur[m].dim))


def _prep_strided_chunk(step, cur, spec, shape):
    m = step.mesh_dims[0]
    return prep_strided_chunk(step, cur, spec, shape, _parent_len(spec, cur, m, step.dst[0].dim))


_PREP = {
    "strided_gather": _prep_strided_gather,
    "strided_chunk": _prep_strided_chunk,
    "p2p": _prep_p2p,
    "all_gather": _prep_gather,
    "all_to_all": _prep_all_to_all,
    "reduce_scatter": _prep_reduce_scatter,
    "all_reduce": _prep_all_reduce,
    "chunk": _prep_chunk,
    "to_partial": _prep_to_partial,
}
