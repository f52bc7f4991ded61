"""Differentiable conversions: from_local, to_local, redistribute, full_tensor (DTensor's methods).

Gradients go back through the inverse layout change. A Partial forward layout
gets a Replicate gradient (every rank's partial value contributes with slope 1
to a sum, 1/n to an average); max/min partials have no such rule and say so.
"""
from __future__ import annotations

import sys
import zlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from shardprop.mesh import collectives as C
from shardprop.mesh import compat
from shardprop.mesh.device_mesh import mesh_or_current
from shardprop.tensor import compile_support
from shardprop.tensor import dtensor as _dt
from shardprop.tensor.layout import local_shape_and_offset
from shardprop.tensor.placement import Partial, Replicate, is_shard_like, normalize_placements, without_partial
from shardprop.tensor.redistribute import plan_redistribute, redistribute_local, run_plan

_is_compiling = torch.compiler.is_compiling


def grad_placements_for(placements):
    """Placements a gradient takes when flowing back to a tensor laid out as ``placements``."""
    return without_partial(placements)


def _check_partial_grad(placements, where: str) -> None:
    bad = [p for p in placements if type(p) is Partial and p.reduce_op in ("max", "min", "product")]
    if bad:
        why = ("each rank's gradient depends on the others' values" if bad[0].reduce_op == "product"
               else "which rank's value wins is not recorded")
        raise RuntimeError(f"{where}: no gradient through {bad[0]!r} ({why}); "
                           "redistribute to Replicate before the differentiable part")


def _scale_avg(local, spec_placements, mesh):
    n = 1
    for m, p in enumerate(spec_placements):
        if type(p) is Partial and p.reduce_op == "avg":
            n *= mesh.shape[m]
    return local / n if n != 1 else local


class FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, mesh, placements, run_check, shape, stride):
        if mesh is None:
            raise ValueError("from_local: give a device_mesh")
        if placements is None:
            placements = [Replicate()] * mesh.ndim
        placements = normalize_placements(placements, local.ndim, mesh.ndim, "from_local")
        ctx.outside = mesh._coord is None
        if run_check and not ctx.outside:  # outside the mesh there is no one to check with
            shape = _checked_global_shape(local, mesh, placements, shape)
            local = _replicas_from_first(local, mesh, placements)
        elif shape is None:
            shape = list(local.shape)
            for m, p in enumerate(placements):
                if is_shard_like(p):  # torch's guess for a strided shard too: even pieces
                    shape[p.dim] *= mesh.shape[m]
        if stride is None:
            stride = _dt.stride_like(local, shape)
        spec = _dt.make_spec(mesh, placements, shape, stride, local.dtype)
        ctx.spec = spec
        if ctx.outside:  # as torch: the global spec over an empty shard
            return _dt.DTensor(local.new_empty(0), spec, requires_grad=False)
        return _dt.DTensor(local.view_as(local), spec, requires_grad=False)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        if ctx.outside:  # the shard given was dropped: nothing flows back into it (torch raises a shape error)
            return None, None, None, None, None, None
        _check_partial_grad(spec.placements, "from_local backward")
        if isinstance(grad, _dt.DTensor):
            target = grad_placements_for(spec.placements)
            local = grad._local_tensor
            if grad._spec.placements != target:
                local = redistribute_local(local, grad._spec, target)
            local = _scale_avg(local, spec.placements, spec.mesh)
        else:
            local = grad
        return local, None, None, None, None, None


class ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt, grad_placements):
        spec = dt._spec
        if grad_placements is not None:
            grad_placements = normalize_placements(grad_placements, dt.ndim, spec.mesh.ndim, "to_local")
            ctx.grad_spec = spec.with_placements(grad_placements)
        else:
            ctx.grad_spec = spec
        return dt._local_tensor.view_as(dt._local_tensor)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.grad_spec
        stride = _dt.stride_like(grad, spec.shape)
        if stride != spec.tensor_meta.stride:  # the gradient's memory order, not the forward's
            spec = _dt.make_spec(spec.mesh, spec.placements, spec.shape, stride, spec.dtype)
        return _dt.DTensor(grad, spec, requires_grad=False), None




class _RefProbe:
    def refs(self) -> int:
        return sys.getrefcount(self)


def _refcounts_as_expected() -> bool:
    """Whether ``obj.method()`` sees 3 references to a named ``obj`` and 2 to a temporary, as on CPython 3.11.

    The temporary test below relies on it; an interpreter that counts differently (borrowed stack
    references, say) turns it off rather than mistake a held tensor for a temporary.
    """
    held = _RefProbe()
    return held.refs() == 3 and _RefProbe().refs() == 2


# Whether the hand-over test can run here: torch counts storage references (private; absent: never guess
# "sole owner"), and CPython counts references as the test expects.
_CAN_HAND_OVER = compat.storage_use_count is not None and _refcounts_as_expected()


def _sole_owner(dt) -> bool:
    """Whether ``dt``'s local tensor, and its memory, are reachable through ``dt`` alone.

    The caller has checked that nothing but its own frame holds ``dt``. Then the local tensor
    must be held by ``dt`` only (its refcount), own its memory (not a view) and share that
    memory with no other tensor (the storage's use count: a view, a ``detach()`` copy, or a
    result autograd saved for backward each hold it). Anything unusual answers False: a
    wrong True silently changes a tensor someone still uses.
    """
    if not _CAN_HAND_OVER or dt._view_base is not None:
        return False
    local = dt._local_tensor
    if type(local) is not torch.Tensor or local.requires_grad:
        return False
    if sys.getrefcount(local) != 3:  # dt's attribute, this frame's name, getrefcount's argument
        return False
    return compat.storage_unshared(local)  # the fast paths hand tensors over on the same test


def _handed_over(dt) -> bool:
    """Whether the caller, which holds the only reference to ``dt``, may hand its local tensor over.

    Never while torch.compile traces (no in-place collectives in a functional graph).
    """
    return not _is_compiling() and _sole_owner(dt)


# (source spec, target placements as the caller gave them) -> (target spec, plan; None: no change).
# A repeated redistribution then skips checking the placements, building the target spec (an
# interning lookup that hashes the shape) and planning: one dict lookup. Filled in eager mode
# only, for interned specs (symbolic ones are not interned and would only pile up).
_TARGETS: dict = {}
_TARGETS_MAX = 4096


def _target(src, placements, ndim: int):
    """(target spec, plan or None) for laying ``src`` out as ``placements`` (checked; a tuple or _REPLICATE_ALL)."""
    mesh = src.mesh
    if placements is None:
        raise ValueError("redistribute: give the target placements")
    key = (src, placements)
    try:
        hit = _TARGETS.get(key)
    except TypeError:  # something unhashable among the placements: the check below names it
        hit = key = None
    if hit is not None:
        return hit
    if type(placements) is str:  # _REPLICATE_ALL
        placements = (Replicate(),) * mesh.ndim
    placements = normalize_placements(placements, ndim, mesh.ndim, "redistribute")
    # Outside the mesh nothing moves (torch's semantics): the empty shard takes the new spec.
    plan = None if src.placements == placements or mesh._coord is None else plan_redistribute(src, placements)
    hit = (src.with_placements(placements), plan)
    if key is not None and not _is_compiling() and not src.is_symbolic:
        if len(_TARGETS) >= _TARGETS_MAX:
            _TARGETS.clear()
        _TARGETS[key] = hit
    return hit


def _same_mesh(dt, device_mesh, placements, async_op: bool, owned: bool) -> "_dt.DTensor":
    """``dt`` laid out as ``placements`` on its own mesh (the body of Redistribute.forward)."""
    src = dt._spec
    if device_mesh is not None and device_mesh is not src.mesh and device_mesh != src.mesh:
        raise ValueError(f"redistribute: cannot move a DTensor from {src.mesh} to a different mesh {device_mesh}; "
                         "redistribution happens within one mesh")
    spec, plan = _target(src, placements, dt.ndim)
    local = dt._local_tensor
    if plan is not None:
        local = run_plan(local, src, plan, async_op=async_op, owned=owned)
    return _dt.DTensor(local, spec, requires_grad=False)


class Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt, device_mesh, placements, async_op, owned=False):
        ctx.src = dt._spec
        out = _same_mesh(dt, device_mesh, placements, async_op, owned)
        # The same layout (styles call this unconditionally under torch.compile, where they cannot
        # read placements): an identity, and its backward passes the gradient on untouched, as if
        # the call were not there (eager skips it). A Partial gradient stays Partial, so the
        # gradients of several consumers of one Replicate input add up locally and the layout
        # change before them (e.g. Shard(1) -> Replicate) reduces once (a reduce-scatter), instead
        # of one all-reduce per consumer.
        ctx.identity = out._spec.placements == ctx.src.placements
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.identity:
            return grad, None, None, None, None
        target = _grad_target(ctx.src.placements)
        if grad._spec.placements != target:
            local = redistribute_local(grad._local_tensor, grad._spec, target)
            grad = _dt.DTensor(local, grad._spec.with_placements(target))
        # No scaling: redistribution keeps the value, so the gradient of the value passes as is
        # (the 1/n of an average belongs to from_local, where local values become the value).
        return grad, None, None, None, None


def _cast(dt, dtype) -> "_dt.DTensor":
    """``dt`` with its local tensor cast to ``dtype`` (no autograd; same layout)."""
    if dtype is None or dtype == dt._local_tensor.dtype:
        return dt
    spec = dt._spec
    meta = spec.tensor_meta
    return _dt.DTensor(dt._local_tensor.to(dtype), _dt.make_spec(spec.mesh, spec.placements, meta.shape, meta.stride,
                                                                 dtype), requires_grad=False)


class RedistributeCast(torch.autograd.Function):
    """``redistribute`` with ``forward_dtype`` / ``backward_dtype`` (torch's keyword arguments).

    Forward: cast to ``forward_dtype``, then the collectives (the result is in ``forward_dtype``).
    Backward: cast the gradient to ``backward_dtype`` (default: the input's dtype), run the
    collectives back, and hand the input's dtype on. Kept apart from :class:`Redistribute` so
    the common call pays nothing for it.
    """

    @staticmethod
    def forward(ctx, dt, device_mesh, placements, async_op, forward_dtype, backward_dtype):
        ctx.src = dt._spec
        ctx.in_dtype = dt._local_tensor.dtype
        ctx.backward_dtype = backward_dtype or ctx.in_dtype
        cast = _cast(dt, forward_dtype)
        out = _same_mesh(cast, device_mesh, placements, async_op, cast is not dt)
        ctx.identity = out._spec.placements == ctx.src.placements
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = _cast(grad, ctx.backward_dtype)
        if not ctx.identity:
            target = _grad_target(ctx.src.placements)
            if grad._spec.placements != target:
                local = redistribute_local(grad._local_tensor, grad._spec, target)
                grad = _dt.DTensor(local, grad._spec.with_placements(target))
        return _cast(grad, ctx.in_dtype), None, None, None, None, None


# Redistribute.apply without its Python wrapper (``Function.apply`` only unwraps functorch wrappers
# when no functorch transform is active, then calls this): a few microseconds less per call on the
# tensor-parallel hot path, where styles redistribute activations several times per block.
_apply_redistribute = super(torch.autograd.Function, Redistribute).apply
_transforms_active = torch._C._are_functorch_transforms_active

# Forward placements -> the placements their gradient is brought to (checked once).
_GRAD_TARGETS: dict = {}


def _grad_target(placements: tuple) -> tuple:
    """``grad_placements_for(placements)``, after checking a gradient can flow back through them (cached)."""
    target = _GRAD_TARGETS.get(placements)
    if target is None:
        _check_partial_grad(placements, "redistribute backward")
        target = grad_placements_for(placements)
        if len(_GRAD_TARGETS) < 1024:
            _GRAD_TARGETS[placements] = target
    return target


# full_tensor's target: Replicate on every mesh dim (a constant torch.compile can put in a graph).
_REPLICATE_ALL = "replicate on every mesh dim"


_MAX_NDIM = 16


def _checked_global_shape(local, mesh, placements, shape):
    """Gather every rank's local metadata in one all-gather; derive and check the global shape on all ranks.

    Ranks must agree on the dtype, requires_grad and the memory order of their pieces (the strides
    they imply for the global tensor), and their shapes must be the pieces of one global shape
    (uneven shards included); else every rank raises the same ValueError, as torch's run_check.
    """
    if local.ndim > _MAX_NDIM:
        raise ValueError(f"from_local(run_check=True): tensors of more than {_MAX_NDIM} dims are not supported")
    group, ranks = mesh.group_for(tuple(range(mesh.ndim)))
    order = _dt.memory_order(local)
    pad = [0] * (_MAX_NDIM - local.ndim)
    mine = torch.tensor([local.ndim, zlib.crc32(str(local.dtype).encode()), int(local.requires_grad)]
                        + list(local.shape) + pad + (list(order) + pad if order is not None else [-1] * _MAX_NDIM),
                        dtype=torch.int64)
    mine = mine.to(local.device) if mesh.device_type != "cpu" else mine
    everyone = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(everyone, mine, group=group)
    everyone = [e.cpu().tolist() for e in everyone]
    ranks = sorted(ranks)  # all_gather fills in group order, which is ascending global rank
    coords = {r: tuple(c) for r, c in zip(ranks, _coords_of(mesh, ranks))}
    problems = []
    for what, at in (("the local tensor's number of dims", 0), ("dtype", 1), ("requires_grad", 2)):
        if len({e[at] for e in everyone}) != 1:
            problems.append(f"ranks disagree on {what}")
    if not problems and len({tuple(e[3 + _MAX_NDIM:]) for e in everyone}) != 1:
        problems.append("ranks disagree on the local tensor's stride (memory order), so on the global stride")
    shapes = {r: tuple(e[3:3 + e[0]]) for r, e in zip(ranks, everyone)}
    if not problems:
        derived = list(shapes[ranks[0]])
        for d in range(len(derived)):
            mdims = [m for m, p in enumerate(placements) if is_shard_like(p) and p.dim == d]
            if mdims:  # sum the pieces along the mesh dims that shard d, others at their first index
                derived[d] = sum(shapes[r][d] for r in ranks
                                 if all(coords[r][m] == 0 for m in range(mesh.ndim) if m not in mdims))
        if shape is not None and tuple(shape) != tuple(derived):
            problems.append(f"the given shape {tuple(shape)} does not match the local shards (they add up to {tuple(derived)})")
        shape = derived
        for r in ranks:
            want, _ = local_shape_and_offset(shape, mesh.shape, coords[r], placements)
            if tuple(want) != shapes[r]:
                problems.append(f"rank {r} holds a {shapes[r]} shard where {list(placements)} of a global "
                                f"{tuple(shape)} needs {tuple(want)}")
                break
    if problems:
        raise ValueError("from_local(run_check=True): inconsistent local tensors across ranks: " + "; ".join(problems))
    return shape


def _replicas_from_first(local, mesh, placements):
    """run_check's promise, as torch's: along each Replicate mesh dim every rank gets the first rank's data.

    Broadcast into a copy: the caller's tensor is left as it was.
    """
    dims = [m for m, p in enumerate(placements) if type(p) is Replicate and mesh.shape[m] > 1]
    if not dims:
        return local
    out = local.clone(memory_format=torch.preserve_format)  # same memory order: the same global stride
    buf = out if out.is_contiguous() else out.contiguous()  # collectives take contiguous buffers
    for m in dims:
        C.broadcast(buf, mesh, (m,), src=0)
    return out if buf is out else out.copy_(buf)


def _coords_of(mesh, ranks):
    flat = mesh.mesh.flatten().tolist()
    out = []
    for r in ranks:
        idx = flat.index(r)
        c = []
        for s in reversed(mesh.shape):
            c.append(idx % s)
            idx //= s
        out.append(list(reversed(c)))
    return out


# ---------------------------------------------------------------- DTensor methods
def from_local(local_tensor: torch.Tensor, device_mesh=None, placements=None, *, run_check: bool = False,
               shape: Optional[Sequence[int]] = None, stride: Optional[Sequence[int]] = None) -> "_dt.DTensor":
    """Wrap this rank's shard as a DTensor (differentiable).

    Without ``device_mesh``, the mesh of the enclosing ``with mesh:`` block is used.
    Without ``shape``, shards are assumed even; ``run_check=True`` gathers every rank's
    local metadata in one small collective, derives the global shape (uneven shards
    included) and raises ValueError on every rank if dtype, requires_grad, memory order
    (stride) or shapes are inconsistent; as torch's, it then gives every rank the data of
    the first rank along each Replicate mesh dim (a broadcast, into a copy). On a rank
    outside ``device_mesh`` the result, as in torch, has the global shape over an empty
    local tensor (the given one is dropped), and nothing is checked or communicated.

    Example:
        >>> dt = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])  # doctest: +SKIP
        >>> dt.shape  # 4 ranks  # doctest: +SKIP
        torch.Size([8, 4])
    """
    device_mesh = mesh_or_current(device_mesh)
    return FromLocal.apply(local_tensor, device_mesh, placements, run_check, shape, stride)


def to_local(self, *, grad_placements=None) -> torch.Tensor:
    """This rank's shard as a plain tensor (differentiable).

    ``grad_placements`` says how the gradient flowing back into the shard is laid out
    (default: this tensor's placements).

    Example:
        >>> dt.to_local().shape  # doctest: +SKIP
    """
    if _is_compiling() or (torch.is_grad_enabled() and self.requires_grad):
        return ToLocal.apply(self, grad_placements)  # torch.compile puts this call in its graph as is
    return self._local_tensor


# Given by shardprop.checkpoint (a room above this one) through set_other_mesh_redistribute:
# ``f(dt, mesh, placements, async_op)`` moves a DTensor to a different mesh. Empty: within one mesh only.
_other_mesh: list = []


def set_other_mesh_redistribute(fn) -> None:
    """Use ``fn(dt, mesh, placements, async_op)`` for redistributions to another mesh (None: refuse them).

    Example:
        >>> set_other_mesh_redistribute(cross_mesh.redistribute_to_mesh)  # doctest: +SKIP
    """
    _other_mesh[:] = [] if fn is None else [fn]


def redistribute(self, device_mesh=None, placements=None, *, async_op: bool = False,
                 forward_dtype: Optional[torch.dtype] = None,
                 backward_dtype: Optional[torch.dtype] = None) -> "_dt.DTensor":
    """The same tensor laid out with ``placements`` (differentiable).

    A ``device_mesh`` other than this tensor's moves it to that mesh (see
    ``shardprop.checkpoint.cross_mesh``; every rank of both meshes must call it).
    As torch's: ``forward_dtype`` casts before the collectives (the result has that dtype);
    ``backward_dtype`` is the dtype the gradient's collectives run in (default: this tensor's
    dtype), and the gradient comes back in this tensor's dtype.

    Example:
        >>> dt.redistribute(placements=[Replicate()])  # doctest: +SKIP
        >>> dt.redistribute(placements=[Replicate()], forward_dtype=torch.bfloat16)  # gathers bf16  # doctest: +SKIP
    """
    if forward_dtype is not None or backward_dtype is not None:
        return _redistribute_cast(self, device_mesh, placements, async_op, forward_dtype, backward_dtype)
    if device_mesh is not None and not _is_compiling() and device_mesh != self._spec.mesh:
        if not _other_mesh:
            raise ValueError(f"redistribute: cannot move a DTensor from {self._spec.mesh} to a different mesh "
                             f"{device_mesh}; redistribution happens within one mesh (import shardprop for "
                             "cross-mesh moves)")
        if placements is None:
            raise ValueError("redistribute: give the target placements")
        return _other_mesh[0](self, device_mesh, placements, async_op)
    if placements is not None and type(placements) is not str:
        placements = tuple(placements)
    # A temporary nobody else references (``(a @ b).redistribute(...)``: only this frame's
    # ``self`` holds it) hands its local tensor over: a Partial -> Replicate all-reduces in place.
    owned = sys.getrefcount(self) == 2 and _handed_over(self)
    if not _is_compiling():
        if not self.requires_grad:  # no graph to record: skip the autograd Function
            return _same_mesh(self, device_mesh, placements, async_op, owned)
        if not _transforms_active():
            return _apply_redistribute(self, device_mesh, placements, async_op, owned)
    # The same-mesh checks run inside (torch.compile records this call whole; a move to another
    # mesh is not supported under torch.compile and raises there).
    return Redistribute.apply(self, device_mesh, placements, async_op, owned)


def _redistribute_cast(self, device_mesh, placements, async_op, forward_dtype, backward_dtype):
    if device_mesh is not None and not _is_compiling() and device_mesh != self._spec.mesh:
        if backward_dtype is not None:
            raise NotImplementedError("redistribute: backward_dtype with a move to another mesh is not supported; "
                                      "cast with .to() around the move instead")
        return redistribute(self.to(forward_dtype), device_mesh, placements, async_op=async_op)
    if placements is not None and type(placements) is not str:
        placements = tuple(placements)
    if not self.requires_grad and not _is_compiling():
        cast = _cast(self, forward_dtype)
        return _same_mesh(cast, device_mesh, placements, async_op, cast is not self)
    return RedistributeCast.apply(self, device_mesh, placements, async_op, forward_dtype, backward_dtype)


def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
    """The whole global tensor on every rank (differentiable).

    Example:
        >>> dt.full_tensor().shape  # doctest: +SKIP
    """
    owned = sys.getrefcount(self) == 2 and _handed_over(self)  # as in redistribute
    if not self.requires_grad and not _is_compiling():
        return _same_mesh(self, None, _REPLICATE_ALL, False, owned)._local_tensor
    full = Redistribute.apply(self, None, _REPLICATE_ALL, False, owned)
    return full.to_local(grad_placements=grad_placements)


# DTensor's from_local/to_local/redistribute/full_tensor are the functions above, given to the class in
# shardprop/assembly.py: they need the autograd functions here, which need the DTensor class, so
# defining them here keeps imports one way (this -> dtensor).


# torch.compile: dynamo cannot trace a wrapper subclass's construction, so it must put these
# three functions in its graph whole (AOTAutograd then traces through them).
compile_support.allow_in_graph(FromLocal, ToLocal, Redistribute, RedistributeCast)
compile_support.when_dynamo_loads(lambda dynamo: compat.dynamo_traces_redistribute_of(_dt.DTensor),
                                  "letting dynamo trace DTensor.redistribute")
compile_support.when_dynamo_loads(lambda dynamo: compat.dynamo_answers_hasattr_of(_dt.DTensor),
                                  "letting hasattr of DTensor methods answer inside compiled code as in eager")
