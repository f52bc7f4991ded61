"""Ops without a sharding rule, run as torch's decomposition of them through the dispatcher.

torch ships Python decompositions (``torch._decomp.decomposition_table``) and
CompositeImplicitAutograd kernels (``op.decompose``) that express an op with
simpler aten ops. Running one on DTensor arguments sends each sub-op back through
``shardprop.dispatch.dispatcher``, so an op with no rule works whenever its pieces have rules,
and every piece is placed by its own rule (no blanket replication).

Three ways in:

* CompositeImplicitAutograd ops (``linear``, ``matmul``, ``einsum``, ``layer_norm``, ...):
  always, as torch's own dispatcher does. With autograd on (grad mode or ``no_grad``)
  torch runs their composite kernel above autograd, so they never reach
  ``__torch_dispatch__``; under ``torch.inference_mode()`` the autograd keys are skipped
  and they arrive whole. Running the same composite kernel here makes every autograd
  mode compute the same thing. Decided at the op's first call (``dispatch.first_call_hook``),
  never per call;
* a curated table (``DEFAULT_OPS``) of ops whose decomposition the OpInfo sweep found
  right on every variant: always on;
* ``shardprop.set_decompose_fallback(True)`` (or env ``SHARDPROP_DECOMPOSE=1``): every op
  that torch can decompose and that has no rule.

All install a special handler per op (``dispatch.register_special``), so ops that have a
rule never pay anything. The handler re-checks for a rule on every call: a rule
registered later (built-in or ``register_sharding``) always wins. A decomposition
that calls its own op again (directly or through a sub-op) does not recurse: the inner
call takes the rule path (and raises the usual no-rule error).
"""
from __future__ import annotations

import functools
import threading

import torch

from shardprop.dispatch import hooks as _hooks
from shardprop.dispatch import dispatcher as dispatch
from shardprop.dispatch import propagate, registry
from shardprop.mesh import config as _config
from shardprop.mesh.config import values as _settings

aten = torch.ops.aten

# Ops without a rule whose decomposition passes the OpInfo sweep on every variant
# (1d, 2d, uneven, backward) through the ops it decomposes into. Names as aten overloads.
# aten.norm.* (reached from F.pairwise_distance and the triplet losses) decompose into
# linalg_vector_norm, which has a rule: the reduction keeps shards off the reduced dims.
DEFAULT_OPS = ["norm.Scalar", "norm.ScalarOpt_dim", "norm.ScalarOpt_dim_dtype", "norm.ScalarOpt_dtype"]

# Ops whose torch decomposition disagrees with the eager kernel (the sweep found it): never decomposed.
# native_batch_norm in eval mode: the decomposition returns saved mean/invstd of shape (C,), eager (0,).
NEVER = {"native_batch_norm.default", "_native_batch_norm_legit.default", "_native_batch_norm_legit.no_stats",
         "_native_batch_norm_legit_no_training.default"}

_installed = set()  # ops this module installed a handler for
_active = threading.local()  # ops whose decomposition is running on this thread


def decomposition(op):
    """torch's decomposition of ``op`` (a callable on the op's arguments), or None.

    Example:
        >>> decomposition(torch.ops.aten.mse_loss.default) is not None
        True
    """
    return _decomposition(op)


@functools.lru_cache(maxsize=None)
def _decomposition(op):
    # The composite kernel first: it is what torch runs for this op in grad mode, so an
    # inference-mode call computes exactly what a grad-mode call does.
    fn = composite_kernel(op)
    if fn is not None or _name(op) in NEVER:
        return fn
    from torch._decomp import decomposition_table
    return decomposition_table.get(op)


_CIA = torch._C.DispatchKey.CompositeImplicitAutograd


@functools.lru_cache(maxsize=None)
def composite_kernel(op):
    """``op``'s C++ CompositeImplicitAutograd kernel as a callable, or None.

    This is the kernel torch's dispatcher runs for the op above autograd (not a Python
    decomposition, which may differ in detail).

    Example:
        >>> composite_kernel(torch.ops.aten.linear.default) is not None
        True
        >>> composite_kernel(torch.ops.aten.mm.default) is None
        True
    """
    if not isinstance(op, torch._ops.OpOverload) or _name(op) in NEVER:
        return None
    try:
        has = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
    except RuntimeError:  # an overload torch lists but the dispatcher does not know
        return None
    if not has:
        return None
    call_key = getattr(op, "_op_dk", None)  # calls the C++ kernel for one dispatch key
    return functools.partial(call_key, _CIA) if call_key is not None else op.decompose


def _name(op) -> str:
    try:
        return f"{op.overloadpacket.__name__}.{op._overloadname}"
    except AttributeError:
        return str(op)


def _handler(op, args, kwargs):
    """Special handler: a rule if one exists now, else the decomposition (once per op per stack)."""
    kwargs = kwargs or {}
    active = getattr(_active, "ops", None)
    if active is None:
        active = _active.ops = set()
    if registry.lookup(op) is not None or op in active:
        return dispatch.run(op, args, kwargs)
    fn = _decomposition(op)
    if fn is None:
        return dispatch.run(op, args, kwargs)
    active.add(op)
    try:
        out = fn(*args, **kwargs)
    finally:
        active.discard(op)
    if out is NotImplemented:  # a table decomposition that declines these arguments
        return dispatch.run(op, args, kwargs)
    return out


def install(op) -> bool:
    """Route ``op`` (when it has no rule) through its decomposition; False if torch has none.

    Example:
        >>> install(torch.ops.aten.mse_loss.default)  # doctest: +SKIP
        True
    """
    if _decomposition(op) is None:
        return False
    current = dispatch.special_handler(op)
    if current is not None and current is not _handler:
        return False  # another special handler owns this op
    dispatch.register_special(op, _handler, outside_safe=True)  # its ops come back through the dispatcher
    _installed.add(op)
    return True


def uninstall(op) -> None:
    """Undo :func:`install` (the op goes back to its rule, or the no-rule error)."""
    if dispatch.special_handler(op) is _handler:
        dispatch.unregister_special(op)
    _installed.discard(op)


def _curated():
    out = []
    for name in DEFAULT_OPS:
        packet, _, ov = name.partition(".")
        p = getattr(aten, packet, None)
        if p is not None and (ov or "default") in p.overloads():
            out.append(getattr(p, ov or "default"))
    return out


def _all_decomposable():
    from torch._decomp import decomposition_table
    return [op for op in decomposition_table if isinstance(op, torch._ops.OpOverload)]


def set_decompose_fallback(enabled: bool) -> None:
    """Run every op that has no sharding rule as torch's decomposition of it (if torch has one).

    Off by default (``SHARDPROP_DECOMPOSE=1`` turns it on at import); the curated
    ``DEFAULT_OPS`` always decompose.

    Example:
        >>> shardprop.set_decompose_fallback(True)   # from here on, ops without a rule decompose
        >>> shardprop.config.values.decompose
        True
        >>> shardprop.set_decompose_fallback(False)
    """
    _config.set("decompose", enabled)  # its watcher, _sync, installs or removes the handlers


def _sync() -> None:
    """Handlers exactly on the wanted ops that have no rule (a rule, even a later one, wins)."""
    wanted = set(_curated())
    if _settings.decompose:
        wanted.update(_all_decomposable())
    for op in list(_installed):
        if registry.lookup(op) is not None or (op not in wanted and composite_kernel(op) is None):
            uninstall(op)
    for op in wanted:
        if op not in _installed and registry.lookup(op) is None and dispatch.special_handler(op) is None:
            install(op)
    # A composite op seen before while it had a rule, whose rule is gone now: decompose it again.
    for op in registry.ops_seen_without_special():
        if registry.lookup(op) is None and composite_kernel(op) is not None:
            install(op)


def _on_first_call(op):
    """``dispatch.first_call_hook``: a composite op without a rule gets the decomposition handler."""
    if registry.lookup(op) is None and composite_kernel(op) is not None and install(op):
        return _handler
    return None


def decompose_fallback_enabled() -> bool:
    """Whether :func:`set_decompose_fallback` is on."""
    return _settings.decompose


def is_decomposed(op) -> bool:
    """Whether a call of ``op`` now runs its decomposition (installed and no rule).

    Example:
        >>> is_decomposed(torch.ops.aten.mm.default)  # has a rule
        False
    """
    return dispatch.special_handler(op) is _handler and registry.lookup(op) is None


def no_rule_hint(op) -> str:
    """The decomposition opt-in for the no-rule error (a ``propagate.no_rule_hints`` hook).

    Example:
        >>> no_rule_hint(torch.ops.aten.mm.default)  # doctest: +SKIP
        ' (torch has no decomposition of it, so the SHARDPROP_DECOMPOSE=1 opt-in cannot serve it)'
    """
    if decomposition(op) is None:
        return " (torch has no decomposition of it, so the SHARDPROP_DECOMPOSE=1 opt-in cannot serve it)"
    if is_decomposed(op):  # its decomposition runs, yet we are here: it called the op again
        return f" (torch's decomposition of it calls {op} again, so it cannot serve)"
    return (", or set SHARDPROP_DECOMPOSE=1 (shardprop.set_decompose_fallback(True)) to run torch's "
            "decomposition of it through the dispatcher")


_config.watch("decompose", lambda _on: _sync())
_sync()
registry.add_listener(_sync)
_hooks.set_first_call_hook(_on_first_call)
propagate.add_no_rule_hint(no_rule_hint)
