"""One switch for every eager fast path, and how the fast paths report to ``explain()``.

The fast paths (the TP styles' local matmuls and lookups in ``parallel.fused_linear``, the
sequence-parallel norms in ``parallel.fused_norm``, the coalesced ``Partial -> Replicate``
gradient sync in ``parallel.grad_sync``, the optimizer foreach default in
``parallel.optim_foreach``, the ``detach`` shortcut in ``ops.scalar``) are optimisations of what
the engine does on DTensors, not second definitions of it. Turning them off makes every one run
the DTensor (engine) path instead: for debugging, and for the differential test that checks both
paths give the same answer.

The switch is read at call time (a module-level bool, one attribute load on the hot path): a
model parallelized with the fast paths on runs the DTensor path while they are off, and the other
way round. Its start value comes from ``SHARDPROP_FAST_PATHS`` (``0``/``false``/``off`` turn them
off; anything else, or unset, leaves them on).

Fast paths report what they ran (local ops, and the collectives they issued, also in backward) to
the same ``dispatcher.recorder`` hook the dispatcher reports op calls to, through
``recorder.record_fast(op, what, inputs, outputs, collectives)`` when the recorder has it.

Example:
    >>> import shardprop
    >>> with shardprop.fast_paths(False):
    ...     shardprop.fast_paths_enabled()
    False
"""
from __future__ import annotations

import contextlib

from shardprop.dispatch.hooks import hooks as _hooks
from shardprop.mesh import collectives as _C
from shardprop.mesh import config as _config

# The switch is the setting ``fast_paths`` (config.values.fast_paths: one attribute load per check).
settings = _config.values


def set_fast_paths(on: bool) -> bool:
    """Turn every eager fast path on or off (read at call time); returns the previous setting.

    Example:
        >>> old = set_fast_paths(False); set_fast_paths(old)
        False
    """
    return _config.set("fast_paths", on)


def fast_paths_enabled() -> bool:
    """Whether the eager fast paths run (see :func:`set_fast_paths`).

    Example:
        >>> fast_paths_enabled() in (True, False)
        True
    """
    return settings.fast_paths


@contextlib.contextmanager
def fast_paths(on: bool = True):
    """Run the block with the fast paths on or off, then restore the previous setting.

    Example:
        >>> with fast_paths(False):  # every style, norm, grad sync and optimizer runs on DTensors
        ...     fast_paths_enabled()
        False
    """
    old = set_fast_paths(on)
    try:
        yield
    finally:
        set_fast_paths(old)


class _Tap(_C.CommCounter):
    """A comm counter that also keeps each collective, in order: (kind, bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list = []

    def add(self, kind: str, nbytes: int) -> None:
        super().add(kind, nbytes)
        self.events.append((kind, nbytes))


def recording() -> bool:
    """Whether a recorder (``explain()``) listens; fast paths then go through :func:`run_recorded`."""
    return _hooks.recorder is not None


def run_recorded(op: str, what: str, inputs: tuple, mesh_dims: tuple, fn, *args):
    """``fn(*args)``, reported to the recorder as the local op ``op`` with the collectives it issued.

    ``inputs`` are the placements the fast path took its inputs in; the output placements are
    read from the result when it is a DTensor. Costs nothing when no recorder listens (callers
    check :func:`recording` first).

    Example:
        >>> run_recorded("linear", "ColwiseParallel on 'up'", ((Replicate(),),), (0,), fwd, x)  # doctest: +SKIP
    """
    rec = _hooks.recorder
    if rec is None or not hasattr(rec, "record_fast"):
        return fn(*args)
    tap = _Tap()
    with _C.comm_counter(tap):
        out = fn(*args)
    outs = tuple(getattr(o, "placements", None) for o in (out if isinstance(out, tuple) else (out,)))
    rec.record_fast(op, what, inputs, outs, tuple((kind, mesh_dims, nbytes) for kind, nbytes in tap.events))
    return out


__all__ = ["fast_paths", "fast_paths_enabled", "set_fast_paths", "run_recorded", "recording"]
