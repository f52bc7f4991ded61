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
parameters with post-accumulate-grad hooks (they must see the final gradient), and
under ``torch.compile``.

Example:
    >>> param.register_hook(grad_like(param, param.placements))  # doctest: +SKIP
    >>> loss.backward()  # one all-reduce for all pending Partial gradients
"""
from __future__ import annotations

import weakref

import torch

from shardprop.mesh import collectives as C
from shardprop.tensor.dtensor import DTensor, make_spec
from shardprop.tensor.placement import Partial, Replicate

_is_compiling = torch.compiler.is_compiling

# (weak param, partial local gradient, group key) recorded in this backward; flushed at its end.
_pending: list = []
_queued_task = None  # the graph task (one backward) whose end runs _flush


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
        dims = _reduced_dims(grad.placements, placements)
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
    if _is_compiling() or torch.is_grad_enabled() or p._post_accumulate_grad_hooks:
        return False
    try:  # autograd.grad captures the gradient without running the parameter's accumulator
        return bool(torch._C._will_engine_execute_node(node))
    except (RuntimeError, AttributeError):
        return False


def _defer(p, grad, placements, dims):
    global _queued_task
    task = torch._C._current_graph_task_id()
    if task != _queued_task:
        # A new backward. Entries left over belong to one that raised before its end (its
        # callback never ran): drop them, and queue this backward's own flush.
        _pending.clear()
        torch.autograd.Variable._execution_engine.queue_callback(_flush)
        _queued_task = task
    local = grad._local_tensor
    spec = grad._spec
    _pending.append((weakref.ref(p), local, (spec.mesh, dims, local.dtype, local.device)))
    zero = torch.zeros_like(local, memory_format=torch.contiguous_format)
    return DTensor(zero, make_spec(spec.mesh, tuple(placements), spec.shape, None, spec.dtype))


def _flush() -> None:
    """End of backward: one all-reduce per group of pending partial gradients, added into ``.grad``."""
    global _queued_task
    _queued_task = None
    pending = list(_pending)
    _pending.clear()
    groups: dict = {}
    for entry in pending:
        groups.setdefault(entry[2], []).append(entry)
    for (mesh, dims, _, _), entries in groups.items():
        locals_ = [e[1] for e in entries]
        flat = torch.cat([t.reshape(-1) for t in locals_]) if len(locals_) > 1 else \
            locals_[0].reshape(-1).clone()
        flat = C.all_reduce(flat, mesh, dims, inplace=True)
        offset = 0
        for (ref, local, _) in entries:
            n = local.numel()
            p = ref()
            if p is not None:
                g = p.grad
                if not isinstance(g, DTensor):
                    raise RuntimeError(f"grad_sync: a parameter's gradient is {type(g).__name__} at the end of "
                                       "backward where a Replicate DTensor was expected (was .grad replaced "
                                       "during backward?)")
                g._local_tensor.add_(flat[offset:offset + n].view(local.shape))
            offset += n


# A pickled DTensor parameter carries its GradLike hook; torch.load's weights_only unpickler may rebuild it.
torch.serialization.add_safe_globals([GradLike])

__all__ = ["GradLike", "grad_like"]
