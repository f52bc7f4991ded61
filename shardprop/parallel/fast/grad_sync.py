"""Gradients of parameters laid out like the parameter, with ``Partial -> Replicate`` reductions coalesced.

A replicated parameter used on sequence-sharded activations (a ``SequenceParallel`` norm
weight, a row-parallel bias) gets a ``Partial`` gradient: each rank's sum over its
sequence piece. Reducing each such gradient in its own hook costs one small all-reduce per
parameter. Instead, during ``loss.backward()`` the hook records the partial local gradient,
hands autograd a zero gradient laid out as ``Replicate`` (so accumulation into ``.grad``
stays exact), and one callback at the end of the backward all-reduces every recorded
gradient in one flat buffer per (mesh, mesh dims, dtype, device) and adds the sums into
``param.grad``. So after ``backward()`` returns, ``param.grad`` is ``Replicate`` and
correct, and accumulation over several backwards stays correct.

The per-hook reduction is kept where deferral would be wrong: ``torch.autograd.grad``
(the parameter's gradient is returned, not accumulated), ``create_graph=True``,
parameters with post-accumulate-grad hooks (they must see the final gradient), parameters
with tensor hooks of the user's after ours (they must see the reduced gradient), and
under ``torch.compile``, and with the fast paths switched off (``shardprop.set_fast_paths(False)``:
each gradient is then redistributed in its own hook, the engine path). While ``explain()`` listens,
each coalesced all-reduce is reported to it.

The fused styles (``fused_linear``, ``fused_norm``) take a parameter's local tensor through
:class:`ParamLocal`, which defers one step earlier: its backward records the partial local
gradient and hands autograd no gradient at all (no zero DTensor, no accumulation of it, no
hook call), and the end-of-backward sum is written into ``param.grad`` (set, or added to an
existing gradient). A parameter with tensor hooks of the user's takes the per-hook path, not
deferred, so those hooks see the reduced gradient exactly as with the fast paths off.

Example:
    >>> param.register_hook(grad_like(param, param.placements))  # doctest: +SKIP
    >>> loss.backward()  # one all-reduce for all pending Partial gradients
"""
from __future__ import annotations

import weakref

import torch

from shardprop.dispatch import fast_paths as _fast
from shardprop.mesh.config import values as _settings
from shardprop.mesh import collectives as C
from shardprop.mesh.state import module_state
from shardprop.tensor.dtensor import DTensor, make_spec
from shardprop.tensor.placement import Partial, Replicate

_is_compiling = torch.compiler.is_compiling

# (weak param, partial local gradient, group key) recorded in this backward; flushed at its end.
_pending: list = []


_state = module_state(queued_task=None)  # the graph task (one backward) whose end runs _flush


class GradLike:
    """A tensor hook giving a parameter a gradient laid out as ``placements`` (coalescing Partial -> Replicate).

    It holds no reference to its parameter (it finds it as the gradient accumulator running it),
    so the parameter can be swapped in place (``model.to(dtype)``, ``to_empty``, which use
    ``torch.utils.swap_tensors``) and the hook pickles as its placements alone; ``rebind(tensor)``
    gives the hook for a copy, which DTensor pickling and ``copy.deepcopy`` use to re-register it
    (torch drops tensor hooks there), so a saved and loaded model keeps its gradient layouts.

    Example:
        >>> p.register_hook(GradLike((Replicate(),)))  # doctest: +SKIP
    """

    __slots__ = ("placements",)

    def __init__(self, placements: tuple):
        self.placements = tuple(placements)

    def rebind(self, tensor: torch.Tensor) -> "GradLike":
        """The hook for ``tensor`` (a copy of the parameter): this one, as it holds no parameter."""
        return self

    def __reduce__(self):
        return (GradLike, (self.placements,))

    def __call__(self, grad):
        placements = self.placements
        if not isinstance(grad, DTensor) or grad.placements == placements:
            return grad
        dims = _reduced_dims(grad.placements, placements) if _settings.fast_paths else None
        if dims is not None:
            node, p = _accumulator()
            if p is not None and _deferrable(p, node):
                return _defer(p, grad, placements, dims)
        return grad.redistribute(placements=placements)


def _accumulator():
    """(gradient accumulator node, its parameter) when a leaf's tensor hook runs in backward; else (None, None)."""
    if _is_compiling():
        return None, None
    try:
        node = torch._C._current_autograd_node()
    except AttributeError:  # a torch without it: every reduction runs in its own hook
        return None, None
    p = getattr(node, "variable", None) if node is not None and type(node).__name__ == "AccumulateGrad" else None
    return (node, p) if isinstance(p, DTensor) else (None, None)


def grad_like(param: torch.Tensor, placements: tuple) -> GradLike:
    """A tensor hook giving ``param`` a gradient laid out as ``placements`` (see :class:`GradLike`).

    Example:
        >>> p.register_hook(grad_like(p, (Replicate(),)))  # doctest: +SKIP
    """
    return GradLike(placements)


def _reduced_dims(have: tuple, want: tuple):
    """Mesh dims where ``have`` is Partial(sum) and ``want`` Replicate, if that is the only difference."""
    dims = []
    for i, (h, w) in enumerate(zip(have, want)):
        if h == w:
            continue
        if type(h) is Partial and h.reduce_op == "sum" and type(w) is Replicate:
            dims.append(i)
        else:
            return None
    return tuple(dims) if dims and len(have) == len(want) else None


def _deferrable(p: torch.Tensor, node) -> bool:
    if _is_compiling() or torch.is_grad_enabled() or p._post_accumulate_grad_hooks or len(p._backward_hooks) > 1:
        return False  # (a user's tensor hook after ours must see the reduced gradient, as on the engine path)
    return _accumulates(node)


def _record(ref, local: torch.Tensor, mesh, dims: tuple) -> None:
    """Add one partial local gradient of the parameter ``ref()`` to this backward's pending reduction."""
    task = torch._C._current_graph_task_id()
    if task != _state.queued_task:
        # A new backward. Entries left over belong to one that raised before its end (its
        # callback never ran): drop them, and queue this backward's own flush.
        _pending.clear()
        torch.autograd.Variable._execution_engine.queue_callback(_flush)
        _state.queued_task = task
    _pending.append((ref, local, (mesh, dims, local.dtype, local.device)))


def _defer(p, grad, placements, dims):
    local = grad._local_tensor
    spec = grad._spec
    _record(weakref.ref(p), local, spec.mesh, dims)
    zero = torch.zeros_like(local, memory_format=torch.contiguous_format)
    return DTensor(zero, make_spec(spec.mesh, tuple(placements), spec.shape, None, spec.dtype))


class ParamLocal(torch.autograd.Function):
    """A DTensor parameter's local tensor; backward: the local gradient as a DTensor laid out as ``grad_spec``.

    When the parameter's accumulator runs in this backward (not ``torch.autograd.grad``), with no
    create_graph, no post-accumulate-grad hook and no tensor hook but ``grad_like``'s, the
    backward accumulates itself and hands autograd no gradient: a partial sum where the
    parameter is replicated (a norm weight applied to a sequence piece) joins the
    end-of-backward all-reduce (see the module docstring); a gradient laid out like the
    parameter becomes ``param.grad`` (or is added to it), as autograd's accumulator would do,
    without a DTensor ``detach``/``add_`` dispatch. Otherwise the DTensor gradient goes to
    autograd as usual. ``grad_spec`` is taken with contiguous strides (the local gradient is made
    contiguous if it is not).

    Example:
        >>> wl = ParamLocal.apply(norm.weight, norm.weight._spec.with_placements((Partial(),)))  # doctest: +SKIP
    """

    @staticmethod
    def forward(ctx, param, grad_spec):
        ctx.grad_spec = grad_spec = grad_spec.contiguous()
        ctx.param = weakref.ref(param)
        placements = param._spec.placements
        ctx.dims = None if grad_spec.placements == placements else _reduced_dims(grad_spec.placements, placements)
        local = param._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.grad_spec
        if not grad.is_contiguous():
            grad = grad.contiguous()
        if not torch.is_grad_enabled():
            p = ctx.param()
            # A tensor hook of the user's (beside grad_like's) must see the gradient: autograd runs it.
            if p is not None and not p._post_accumulate_grad_hooks and len(p._backward_hooks or ()) <= 1 \
                    and _accumulates(ctx.next_functions[0][0]):
                dims = ctx.dims
                if dims is not None:
                    _record(ctx.param, grad, spec.mesh, dims)
                    return None, None
                if spec.placements == p._spec.placements and _accumulate(p, grad, spec):
                    return None, None
        return DTensor(grad, spec), None


def _accumulate(p, grad: torch.Tensor, spec) -> bool:
    """Set or add ``grad`` (local, laid out as ``spec``, like ``p``) into ``p.grad``; False to leave it to autograd."""
    g = p.grad
    if g is None:
        if grad._base is not None:  # a view shares storage with other gradients: .grad must own its memory
            grad = grad.clone()
        p.grad = DTensor(grad, spec)
        return True
    if type(g) is DTensor and g._spec.placements == spec.placements and g._local_tensor.shape == grad.shape:
        g._local_tensor.add_(grad)
        return True
    return False


def _accumulates(node) -> bool:
    """Whether this backward runs the accumulator ``node`` (autograd.grad captures instead, and says so by raising)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (RuntimeError, AttributeError):
        return False


def _flush() -> None:
    """End of backward: one all-reduce per group of pending partial gradients, added into ``.grad``."""
    _state.queued_task = None
    pending = list(_pending)
    _pending.clear()
    groups: dict = {}
    for entry in pending:
        groups.setdefault(entry[2], []).append(entry)
    for (mesh, dims, _, _), entries in groups.items():
        locals_ = [e[1] for e in entries]
        flat = torch.cat([t.reshape(-1) for t in locals_]) if len(locals_) > 1 else \
            locals_[0].reshape(-1).clone()
        if _fast.recording():
            flat = _fast.run_recorded("all_reduce", f"fast path: coalesced Partial -> Replicate of {len(entries)} "
                                      "parameter gradients", ((Partial(),) * len(dims),), dims,
                                      C.all_reduce, flat, mesh, dims, inplace=True)
        else:
            flat = C.all_reduce(flat, mesh, dims, inplace=True)
        offset = 0
        for (ref, local, _) in entries:
            n = local.numel()
            p = ref()
            if p is not None:
                g = p.grad
                if g is None:  # deferred by ParamLocal, no other gradient: the sum is the gradient
                    p.grad = DTensor(flat[offset:offset + n].view(local.shape), p._spec.contiguous())
                    offset += n
                    continue
                if not isinstance(g, DTensor):
                    raise RuntimeError(f"grad_sync: a parameter's gradient is {type(g).__name__} at the end of "
                                       "backward where a Replicate DTensor was expected (was .grad replaced "
                                       "during backward?)")
                g._local_tensor.add_(flat[offset:offset + n].view(local.shape))
            offset += n


# A pickled DTensor parameter carries its GradLike hook; torch.load's weights_only unpickler may rebuild it.
torch.serialization.add_safe_globals([GradLike])

__all__ = ["GradLike", "ParamLocal", "grad_like"]


_fast.register("grad_sync", "shardprop.parallel.fast.grad_sync",
               "each partial parameter gradient reduced on its own (DTensor redistribute Partial -> Replicate)",
               ("SequenceParallel", "RowwiseParallel"))
